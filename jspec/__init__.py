"""jspec: speculative decoding for LLMs in JAX, written as pure functions.

The front doors: ``load_hf`` / ``load_gguf`` / ``save`` / ``restore`` (checkpoints; real models
by name through ``jspec.io.load_model``), ``generate`` and ``score``
(plain decoding), ``speculative_generate`` with a drafter from ``jspec.drafters``; ``shard`` places
a model and its drafter on a device mesh (tensor parallelism).
"""

import warnings as _warnings
from pathlib import Path as _Path

from jspec import drafters, io
from jspec.engine import generate, score
from jspec.execution import Execution, Kernels, with_kernels
from jspec.io import load_gguf, restore, save
from jspec.kv import KVCache
from jspec.models import forward, init_params  # dispatch on the model family
from jspec.models.base import Capture
from jspec.models.gemma4 import Gemma4Config
from jspec.models.llama import LlamaConfig, Model
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
    "restore",
    "save",
    "score",
    "shard",
    "speculative_generate",
    "tensor_parallel_mesh",
    "with_kernels",
]
