"""The HF tensor layout of Gemma 4 checkpoints -> ``jspec.models.gemma4.Model``.

``Gemma4ForCausalLM`` stores the text model under ``model.*``; ``Gemma4ForConditionalGeneration``
under ``model.language_model.*`` next to vision / audio towers, which are skipped. Names are
canonicalised to the ``model.*`` form before the same checks as for Llama: a missing,
unexpected or mis-shaped tensor raises ``ValueError`` naming it. No file access here:
``jspec.io`` opens the checkpoint and hands over ``get(name, transpose=False)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jspec.models.gemma4.config import Gemma4Config
from jspec.models.gemma4.model import Layer, Model, PerLayerEmbedding

_TEXT_PREFIX = {"Gemma4ForCausalLM": "model.", "Gemma4ForConditionalGeneration": "model.language_model."}
# Parts of a multimodal checkpoint the text model does not read.
_MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
# KV-shared layers have no K/V weights; checkpoints may still carry them (HF ignores them too).
_SHARED_KV_TENSOR = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight")


def hf_tensors(c: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Canonical (``model.*``) HF tensor name -> shape (PyTorch ``(out, in)`` layout)."""
    H, P = c.hidden_size, c.hidden_size_per_layer_input
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    if P:
        shapes |= {
            "model.embed_tokens_per_layer.weight": (c.vocab_size_per_layer_input, c.num_layers * P),
            "model.per_layer_model_projection.weight": (c.num_layers * P, H),
            "model.per_layer_projection_norm.weight": (P,),
        }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        kv_heads, hd = c.attention_shape(i)
        inter = c.mlp_size(i)
        shapes |= {
            p + "layer_scalar": (1,),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "pre_feedforward_layernorm.weight": (H,),
            p + "post_feedforward_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (c.num_heads * hd, H),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.o_proj.weight": (H, c.num_heads * hd),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        }
        if c.kv_source(i) == i:
            shapes |= {p + "self_attn.k_proj.weight": (kv_heads * hd, H), p + "self_attn.k_norm.weight": (hd,)}
            if c.has_v_proj(i):
                shapes[p + "self_attn.v_proj.weight"] = (kv_heads * hd, H)
        if P:
            shapes |= {
                p + "per_layer_input_gate.weight": (P, H),
                p + "per_layer_projection.weight": (H, P),
                p + "post_per_layer_input_norm.weight": (H,),
            }
    return shapes


def hf_names(cfg: dict[str, Any], config: Gemma4Config, disk: Iterable[str]) -> dict[str, str]:
    """``{canonical name: name on disk}`` for every tensor the text model may read."""
    del cfg
    prefix = _TEXT_PREFIX[config.architecture]
    names = {}
    for name in disk:
        if name.startswith(_MULTIMODAL_PREFIXES):
            continue
        canonical = "model." + name[len(prefix) :] if name.startswith(prefix) else name
        shared = _SHARED_KV_TENSOR.fullmatch(canonical)
        if shared and int(shared.group(1)) >= config.first_kv_shared_layer:
            continue
        names[canonical] = name
    return names


def build(get: Callable[..., np.ndarray], config: Gemma4Config, *, progress: bool = False) -> Model:
    """The ``Model`` from checked tensors, addressed by canonical names."""

    def arr(name, transpose=False):
        return jnp.asarray(get(name, transpose))

    def fused(names):
        return jnp.concatenate([arr(n, transpose=True) for n in names], axis=-1)

    layers = []
    for i in tqdm(range(config.num_layers), desc="layers", disable=not progress):
        p = f"model.layers.{i}."
        owns_kv = config.kv_source(i) == i
        projections = ["q", "k", "v"] if owns_kv and config.has_v_proj(i) else ["q", "k"] if owns_kv else ["q"]
        ple = config.hidden_size_per_layer_input > 0
        layers.append(
            Layer(
                attn_norm=arr(p + "input_layernorm.weight"),
                qkv=fused([p + f"self_attn.{x}_proj.weight" for x in projections]),
                q_norm=arr(p + "self_attn.q_norm.weight"),
                o=arr(p + "self_attn.o_proj.weight", transpose=True),
                post_attn_norm=arr(p + "post_attention_layernorm.weight"),
                mlp_norm=arr(p + "pre_feedforward_layernorm.weight"),
                gate_up=fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=arr(p + "mlp.down_proj.weight", transpose=True),
                post_mlp_norm=arr(p + "post_feedforward_layernorm.weight"),
                layer_scalar=arr(p + "layer_scalar"),
                k_norm=arr(p + "self_attn.k_norm.weight") if owns_kv else None,
                ple_gate=arr(p + "per_layer_input_gate.weight", transpose=True) if ple else None,
                ple_proj=arr(p + "per_layer_projection.weight", transpose=True) if ple else None,
                ple_norm=arr(p + "post_per_layer_input_norm.weight") if ple else None,
            )
        )
    per_layer = None
    if config.hidden_size_per_layer_input:
        per_layer = PerLayerEmbedding(
            embed=arr("model.embed_tokens_per_layer.weight"),
            projection=arr("model.per_layer_model_projection.weight", transpose=True),
            norm=arr("model.per_layer_projection_norm.weight"),
        )
    return Model(
        embed=arr("model.embed_tokens.weight"),
        layers=tuple(layers),
        final_norm=arr("model.norm.weight"),
        lm_head=None if config.tie_word_embeddings else arr("lm_head.weight", transpose=True),
        ple=per_layer,
        config=config,
    )
