"""Checkpoint I/O: HF safetensors directories (shards, index, validation, architecture dispatch
to the families' weight maps) and jspec's own orbax checkpoints."""

from jspec.io.hf import config_from_hf, load_hf
from jspec.io.orbax import is_jspec_checkpoint, restore, save

__all__ = ["config_from_hf", "is_jspec_checkpoint", "load_hf", "restore", "save"]
