"""jspec: speculative decoding for LLMs in JAX, written as pure functions."""

from jspec.checkpoint import load_hf, restore, save
from jspec.config import LlamaConfig
from jspec.engine import generate, score
from jspec.kv import KVCache
from jspec.models.llama import Model, forward, init_params
from jspec.sampling import SamplingParams

__all__ = [
    "KVCache",
    "LlamaConfig",
    "Model",
    "SamplingParams",
    "forward",
    "generate",
    "init_params",
    "load_hf",
    "restore",
    "save",
    "score",
]

from jspec import drafters  # noqa: E402
from jspec.speculative import SpecResult, speculative_generate  # noqa: E402
from jspec.drafter_checkpoint import load_hf_mtp  # noqa: E402

__all__ += ["SpecResult", "drafters", "load_hf_mtp", "speculative_generate"]
