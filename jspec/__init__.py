"""jspec: speculative decoding for LLMs in JAX, written as pure functions."""

from jspec.checkpoint import load_hf, restore, save
from jspec.config import LlamaConfig
from jspec.gemma4_config import Gemma4Config
from jspec.engine import generate, score
from jspec.kv import KVCache
from jspec.models import forward, init_params  # dispatch on the model family
from jspec.models.llama import Model
from jspec.sampling import SamplingParams

__all__ = [
    "Gemma4Config",
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
