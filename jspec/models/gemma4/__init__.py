"""Gemma 4 dense text decoders: config (``config``), forward and parameters (``model``), HF
tensor layout (``weights``)."""

from jspec.models.gemma4.config import FULL, SLIDING, Gemma4Config, Gemma4Rope, from_hf_config, is_gemma4_config
from jspec.models.gemma4.model import Layer, Model, PerLayerEmbedding, forward, init_params

__all__ = [
    "FULL",
    "SLIDING",
    "Gemma4Config",
    "Gemma4Rope",
    "Layer",
    "Model",
    "PerLayerEmbedding",
    "forward",
    "from_hf_config",
    "init_params",
    "is_gemma4_config",
]
