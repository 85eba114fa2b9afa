"""The HF tensor layout of Llama 3 / Qwen2 / Qwen3 checkpoints -> ``Model``.

No file access here: ``jspec.io`` opens the checkpoint and hands over ``get(name, transpose=False)``
(a device array in the target dtype, or a ``QuantizedWeight`` for a matmul weight or table kept in a
file's quantization; ``transpose`` turns PyTorch's ``[out, in]`` into ``[in, out]``; a tuple of names
gives the tensors fused along the last axis, written once into one buffer). The
layer map is shared with the drafter heads built from Llama layers (EAGLE-3, MTP).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jspec.models.llama.config import LlamaConfig
from jspec.models.llama.model import Layer, Model

Getter = Callable[..., jax.Array]


def layer_tensors(c: LlamaConfig, prefix: str, in_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape (PyTorch ``(out, in)`` layout) of one decoder layer under
    ``prefix``; q/k/v read ``in_size`` columns (default ``hidden_size``)."""
    H, hd, inp = c.hidden_size, c.head_dim, in_size or c.hidden_size
    shapes = {
        prefix + "input_layernorm.weight": (H,),
        prefix + "post_attention_layernorm.weight": (H,),
        prefix + "self_attn.q_proj.weight": (c.q_size, inp),
        prefix + "self_attn.k_proj.weight": (c.kv_size, inp),
        prefix + "self_attn.v_proj.weight": (c.kv_size, inp),
        prefix + "self_attn.o_proj.weight": (H, c.q_size),
        prefix + "mlp.gate_proj.weight": (c.intermediate_size, H),
        prefix + "mlp.up_proj.weight": (c.intermediate_size, H),
        prefix + "mlp.down_proj.weight": (H, c.intermediate_size),
    }
    if c.qkv_bias:
        shapes |= {
            prefix + "self_attn.q_proj.bias": (c.q_size,),
            prefix + "self_attn.k_proj.bias": (c.kv_size,),
            prefix + "self_attn.v_proj.bias": (c.kv_size,),
        }
    if c.qk_norm:
        shapes |= {prefix + "self_attn.q_norm.weight": (hd,), prefix + "self_attn.k_norm.weight": (hd,)}
    return shapes


def hf_tensors(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape (PyTorch ``(out, in)`` layout) of the whole model."""
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        shapes |= layer_tensors(c, f"model.layers.{i}.")
    return shapes


def num_mtp_layers(cfg: dict[str, Any]) -> int:
    """MTP layers an HF config declares (DeepSeek ``num_nextn_predict_layers``, Qwen3-Next /
    Qwen3.5 ``mtp_num_hidden_layers``)."""
    return int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)


def is_mtp_tensor(name: str, cfg: dict[str, Any]) -> bool:
    """Tensors of the MTP layers the config declares (the target skips them, as transformers
    does); without a declaration nothing is skipped, so stray tensors still fail the load."""
    n = num_mtp_layers(cfg)
    if n == 0:
        return False
    if name.startswith("mtp."):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    L = int(cfg.get("num_hidden_layers", 0))
    return m is not None and L <= int(m.group(1)) < L + n


def hf_names(cfg: dict[str, Any], config: LlamaConfig, disk_names: Iterable[str]) -> dict[str, str]:
    """``{name: name on disk}`` of the tensors the target reads (MTP layers left out)."""
    del config
    return {n: n for n in disk_names if not is_mtp_tensor(n, cfg)}


def read_layer(get: Getter, c: LlamaConfig, prefix: str) -> Layer:
    """One decoder layer from the tensors under ``prefix``."""

    def fused(names):
        return get(tuple(names), True)

    p = prefix
    return Layer(
        attn_norm=get(p + "input_layernorm.weight"),
        qkv=fused([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
        o=get(p + "self_attn.o_proj.weight", True),
        mlp_norm=get(p + "post_attention_layernorm.weight"),
        gate_up=fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
        down=get(p + "mlp.down_proj.weight", True),
        qkv_bias=get(tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv")) if c.qkv_bias else None,
        q_norm=get(p + "self_attn.q_norm.weight") if c.qk_norm else None,
        k_norm=get(p + "self_attn.k_norm.weight") if c.qk_norm else None,
    )


def layer_arrays(layer: Layer, c: LlamaConfig, prefix: str) -> dict[str, Any]:
    """The inverse of :func:`read_layer`: HF tensor name -> array in PyTorch's ``[out, in]``
    layout (fused q/k/v and gate/up split again)."""
    p = prefix
    q, k, v = jnp.split(layer.qkv, [c.q_size, c.q_size + c.kv_size], axis=1)
    gate, up = jnp.split(layer.gate_up, 2, axis=1)
    out = {
        p + "input_layernorm.weight": layer.attn_norm,
        p + "post_attention_layernorm.weight": layer.mlp_norm,
        p + "self_attn.q_proj.weight": q.T,
        p + "self_attn.k_proj.weight": k.T,
        p + "self_attn.v_proj.weight": v.T,
        p + "self_attn.o_proj.weight": layer.o.T,
        p + "mlp.gate_proj.weight": gate.T,
        p + "mlp.up_proj.weight": up.T,
        p + "mlp.down_proj.weight": layer.down.T,
    }
    if layer.qkv_bias is not None:
        for name, bias in zip("qkv", jnp.split(layer.qkv_bias, [c.q_size, c.q_size + c.kv_size])):
            out[p + f"self_attn.{name}_proj.bias"] = bias
    if layer.q_norm is not None:
        out |= {p + "self_attn.q_norm.weight": layer.q_norm, p + "self_attn.k_norm.weight": layer.k_norm}
    return out


def build(get: Getter, config: LlamaConfig, *, progress: bool = False) -> Model:
    """The ``Model`` from checked tensors (``jspec.io`` has verified names and shapes)."""
    layers = tuple(
        read_layer(get, config, f"model.layers.{i}.")
        for i in tqdm(range(config.num_layers), desc="layers", disable=not progress)
    )
    return Model(
        embed=get("model.embed_tokens.weight"),
        layers=layers,
        final_norm=get("model.norm.weight"),
        lm_head=None if config.tie_word_embeddings else get("lm_head.weight", True),
        config=config,
    )

