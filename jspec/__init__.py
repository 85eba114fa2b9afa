"""jspec: speculative decoding for LLMs in JAX, written as pure functions.

The front doors: ``load_hf`` / ``load_gguf`` / ``save`` / ``restore`` (checkpoints; real models
by name through ``jspec.io.load_model``), ``generate`` and ``score``
(plain decoding), ``speculative_generate`` with a drafter from ``jspec.drafters``; ``shard`` places
a model and its drafter on a device mesh (tensor parallelism); ``quantize`` gives a model or a drafter
int8, fp8 or int4 weights (``jspec.quant``).
"""

import warnings as _warnings
from os import PathLike as _PathLike
from pathlib import Path as _Path

from jspec import drafters, io
from jspec.engine import generate, score
from jspec.execution import Execution, Kernels, with_kernels
from jspec.io import load_gguf, restore
from jspec.kv import KVCache
from jspec.models import forward, init_params  # dispatch on the model family
from jspec.models.base import Capture
from jspec.models.gemma4 import Gemma4Config
from jspec.models.llama import LlamaConfig, Model
from jspec.quant import quantize
from jspec.sampling import SamplingParams
from jspec.sharding import shard, tensor_parallel_mesh
from jspec.speculative import SpecResult, speculative_generate
from jspec.text import Tokenizer


def load_hf(path, *, dtype=None, progress: bool = False):
    """Load an HF target checkpoint directory (Llama 3 / Qwen2 / Qwen3 / Gemma 4) or a GGUF file
    (Llama / Qwen2 / Qwen3); see ``jspec.io.load_hf``.

    Deprecated for drafter heads: an EAGLE-3 head directory still gives its ``Eagle3Head``,
    with a ``DeprecationWarning``; use ``jspec.drafters.Eagle3.load(path)``.
    """
    if io.is_gguf(path):
        return io.load_gguf(path, dtype=dtype, progress=progress)
    if drafters.eagle3.is_eagle3_config(io.safetensors.read_json(_Path(path) / "config.json")):
        _warnings.warn(
            "jspec.load_hf on an EAGLE-3 head is deprecated; use jspec.drafters.Eagle3.load(path)",
            DeprecationWarning, stacklevel=2,
        )
        return drafters.eagle3.load_head(path, dtype=dtype)
    return io.load_hf(path, dtype=dtype, progress=progress)


def save(model, path, *, tokenizer=None, overwrite: bool = False) -> None:
    """Write ``model`` to the directory ``path`` as a jspec checkpoint (``jspec.io.save``: config and
    orbax parameters, bit-exact, atomic) and, given its tokenizer, the tokenizer and chat template
    beside them as HF files, so the directory is a complete model: ``jspec.Tokenizer.from_pretrained(path)``
    reads the same tokenizer back and ``scripts/generate.py --model path`` runs it on text.

    Args:
      model: the ``Model`` to write.
      path: the checkpoint directory; absent or empty unless ``overwrite``.
      tokenizer: None (the weights alone), a ``jspec.Tokenizer``, or what
        ``jspec.Tokenizer.from_pretrained`` reads one from (a known model name, a GGUF file, an HF
        directory).
      overwrite: replace a checkpoint already at ``path``.

    Raises:
      ValueError: ``tokenizer`` is of another type, cannot be read, or has more ids than the
        model's vocabulary (it belongs to another model); raised before anything is written.
      FileExistsError: ``path`` is not empty and ``overwrite`` is False.
    """
    files = {} if tokenizer is None else _tokenizer_of(tokenizer, model.config.vocab_size).to_hf_files()
    io.save(model, path, overwrite=overwrite, files=files)


def _tokenizer_of(tokenizer, vocab_size: int) -> Tokenizer:
    """``save``'s ``tokenizer`` argument as a ``Tokenizer`` that fits a vocabulary of ``vocab_size``."""
    if isinstance(tokenizer, (str, _PathLike)):
        tokenizer = Tokenizer.from_pretrained(tokenizer)
    elif not isinstance(tokenizer, Tokenizer):
        raise ValueError(
            "tokenizer must be a jspec.Tokenizer, or a known model name, GGUF file or HF directory to read "
            f"one from; got a {type(tokenizer).__name__}"
        )
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary only {vocab_size}: "
            "it is another model's tokenizer"
        )
    return tokenizer


def load_hf_mtp(path, *, dtype=None):
    """Deprecated: the ``MTPHead`` of a target checkpoint; use ``jspec.drafters.MTP.load(path)``."""
    _warnings.warn(
        "jspec.load_hf_mtp is deprecated; use jspec.drafters.MTP.load(path)", DeprecationWarning, stacklevel=2
    )
    return drafters.mtp.load_head(path, dtype=dtype)


__all__ = [
    "Capture",
    "Execution",
    "Gemma4Config",
    "KVCache",
    "Kernels",
    "LlamaConfig",
    "Model",
    "SamplingParams",
    "SpecResult",
    "Tokenizer",
    "drafters",
    "forward",
    "generate",
    "init_params",
    "io",
    "load_gguf",
    "load_hf",
    "load_hf_mtp",
    "quantize",
    "restore",
    "save",
    "score",
    "shard",
    "speculative_generate",
    "tensor_parallel_mesh",
    "with_kernels",
]
