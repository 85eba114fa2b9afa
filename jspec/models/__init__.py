"""Target model families as pure forward functions."""

from jspec.models.llama import Layer, Model, forward, init_params

__all__ = ["Layer", "Model", "forward", "init_params"]
