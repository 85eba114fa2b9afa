"""DFlash checkpoints in the published layout (z-lab/dflash; SGLang's and vLLM's loaders read the
same): ``config.json`` (:mod:`jspec.drafters.dflash.config`) and safetensors with ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` and Qwen3 ``layers.{i}.*`` tensors, optionally under a
``model.`` prefix; no embedding, no LM head."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import jax.numpy as jnp

from jspec.drafters.dflash.config import ARCHITECTURE, DFlashConfig, config_from_hf
from jspec.drafters.dflash.head import DFlashHead
from jspec.io.orbax import write_hf_directory
from jspec.io.safetensors import TensorReader, check_tensors, checkpoint_dtype, read_json, tensor_files
from jspec.models.llama import to_hf_config
from jspec.models.llama.weights import layer_arrays, layer_tensors, read_layer


def expected_tensors(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape (PyTorch ``(out, in)`` layout) of a DFlash checkpoint."""
    c, H = config.layer, config.hidden_size
    shapes = {"fc.weight": (H, len(config.target_layer_ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c.num_layers):
        shapes |= layer_tensors(c, f"layers.{i}.")
    return shapes


def load_head(path, *, dtype=None) -> DFlashHead:
    """The head of a DFlash checkpoint directory; ``dtype`` None keeps the stored one."""
    path = Path(path)
    config = config_from_hf(read_json(path / "config.json"))
    files = tensor_files(path)
    reader = TensorReader(files, {(n[len("model."):] if n.startswith("model.") else n): n for n in files})
    with reader:
        check_tensors(reader, reader.names, expected_tensors(config))
        get = reader.getter(checkpoint_dtype(reader, "fc.weight", dtype))
        return DFlashHead(
            fc=jnp.asarray(get("fc.weight", True)),
            hidden_norm=jnp.asarray(get("hidden_norm.weight")),
            layers=tuple(read_layer(get, config.layer, f"layers.{i}.") for i in range(config.layer.num_layers)),
            norm=jnp.asarray(get("norm.weight")),
            config=config,
        )


def save_head(head: DFlashHead, path, *, metadata: dict | None = None) -> None:
    """Write ``head`` in the published layout (readable by :func:`load_head` and the engines'
    DFlash loaders); ``metadata`` goes into ``config.json`` under ``"jspec"``. Written atomically."""
    config, c = head.config, head.config.layer
    tensors = {"fc.weight": head.fc.T, "hidden_norm.weight": head.hidden_norm, "norm.weight": head.norm}
    for i, layer in enumerate(head.layers):
        tensors |= layer_arrays(layer, c, f"layers.{i}.")
    hf = to_hf_config(c) | dict(
        architectures=[ARCHITECTURE], block_size=config.block_size, num_target_layers=config.num_target_layers,
        dflash_config=dict(mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids)),
        torch_dtype=np.dtype(head.fc.dtype).name,
    )
    if config.layer_types is not None:
        hf |= dict(layer_types=list(config.layer_types), sliding_window=config.sliding_window, use_sliding_window=True)
    write_hf_directory(path, hf, tensors, metadata=metadata)
