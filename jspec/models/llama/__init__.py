"""Llama 3 / Qwen2 / Qwen3: config (``config``), forward and parameters (``model``), HF tensor
layout (``weights``)."""

from jspec.models.llama.config import LlamaConfig, RopeScaling, from_hf_config, is_llama_config, to_hf_config
from jspec.models.llama.model import Layer, Model, decoder_layer, forward, init_layer, init_params

__all__ = [
    "Layer",
    "LlamaConfig",
    "Model",
    "RopeScaling",
    "decoder_layer",
    "forward",
    "from_hf_config",
    "init_layer",
    "init_params",
    "is_llama_config",
    "to_hf_config",
]
