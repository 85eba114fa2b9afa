"""jspec checkpoints: the config as JSON beside an orbax checkpoint of the parameters."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jspec.io.safetensors import read_json
from jspec.models import AnyConfig, AnyModel, gemma4, init_params, llama
from jspec.parallel import plain_order
from jspec.quant import quantize_like, quantized_layout

_CONFIG_FILE = "jspec_config.json"
_PARAMS_DIR = "params"
# The ``architecture`` field of a stored config names its family's config class.
_CONFIG_CLASSES = {arch: gemma4.Gemma4Config for arch in gemma4.config.GEMMA4_ARCHITECTURES}


def is_jspec_checkpoint(path) -> bool:
    return (Path(path) / _CONFIG_FILE).exists()


def config_to_dict(config: AnyConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_dict(d: dict) -> AnyConfig:
    """Inverse of ``config_to_dict``."""
    return _CONFIG_CLASSES.get(d.get("architecture"), llama.LlamaConfig).from_dict(d)


def save(model: AnyModel, path, *, overwrite: bool = False, files: Mapping[str, str] | None = None) -> None:
    """Write ``model`` to the directory ``path`` (config JSON + orbax parameter checkpoint).

    Atomic: everything is written into a temporary directory beside ``path`` and renamed into
    place, so an interrupted save leaves either the previous checkpoint (``overwrite=True``) or
    none, never a config that does not match its parameters. The previous checkpoint is renamed
    aside first and deleted only once the new one is in place.

    ``files``: text files written beside the parameters in the same step (``{file name: contents}``,
    e.g. a tokenizer's HF files, which ``jspec.save`` passes); a name that is not a plain file
    name, or is the checkpoint's own, is a ``ValueError`` before anything is written.
    """
    import orbax.checkpoint as ocp

    files = dict(files or {})
    if bad := [n for n in files if n in (_CONFIG_FILE, _PARAMS_DIR, ".", "..") or Path(n).name != n]:
        raise ValueError(f"cannot write {bad[0]!r} beside a checkpoint: give plain file names other than "
                         f"{_CONFIG_FILE!r} and {_PARAMS_DIR!r}")
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True to replace it)")
    model = plain_order(model)  # a placed model's fused weights are stored device-major
    with atomic_directory(path) as staging:
        meta = {"config": config_to_dict(model.config), "dtype": np.dtype(model.dtype).name,
                "quantized": quantized_layout(model)}
        (staging / _CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(staging / _PARAMS_DIR, model, force=True)
            ckptr.wait_until_finished()


@contextlib.contextmanager
def atomic_directory(path):
    """Yield a temporary directory beside ``path`` to write into; when the block ends normally it
    is renamed to ``path`` (an existing ``path`` renamed aside first -- a crash in between leaves it
    there, complete -- and deleted last), otherwise removed, leaving ``path`` as it was."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.saving-", dir=path.parent))
    try:
        yield staging
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}") if path.exists() else None
        if old is not None:
            path.rename(old)
        staging.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_hf_directory(path, config: dict, tensors: Mapping, *, metadata: dict | None = None) -> None:
    """Write an HF-layout directory atomically: ``config.json`` (``metadata`` under ``"jspec"``) and
    ``model.safetensors`` holding ``tensors`` (name -> array, PyTorch's layout) as contiguous numpy."""
    from safetensors.numpy import save_file

    config = dict(config, jspec=metadata) if metadata else config
    with atomic_directory(path) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        save_file({name: np.ascontiguousarray(np.asarray(x)) for name, x in tensors.items()},
                  str(staging / "model.safetensors"), metadata={"format": "pt"})


def restore(path) -> AnyModel:
    """Read a ``Model`` written by ``save``; the arrays come back bit-exactly, quantized weights as
    they were saved."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = read_json(path / _CONFIG_FILE)
    config = config_from_dict(meta["config"])
    dtype = jnp.dtype(getattr(ml_dtypes, meta["dtype"], meta["dtype"]))
    # A checkpoint without quantized weights records none.
    layout = meta.get("quantized", {})
    abstract = jax.eval_shape(lambda: quantize_like(init_params(config, jax.random.key(0), dtype), layout))
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path / _PARAMS_DIR, abstract)
