"""HF Gemma 4 safetensors checkpoints -> ``jspec.models.gemma4.Model`` (``jspec.load_hf`` calls it).

``Gemma4ForCausalLM`` stores the text model under ``model.*``; ``Gemma4ForConditionalGeneration``
under ``model.language_model.*`` next to vision / audio towers, which are skipped. Names are
canonicalised to the ``model.*`` form before the same checks as for Llama: a missing,
unexpected or mis-shaped tensor raises ``ValueError`` naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jspec.checkpoint import _check_tensors, _tensor_files, _TensorReader
from jspec.gemma4_config import Gemma4Config, gemma4_config_from_hf
from jspec.models.gemma4 import Layer, Model, PerLayerEmbedding

_TEXT_PREFIX = {"Gemma4ForCausalLM": "model.", "Gemma4ForConditionalGeneration": "model.language_model."}
# Parts of a multimodal checkpoint the text model does not read.
_MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
# KV-shared layers have no K/V weights; checkpoints may still carry them (HF ignores them too).
_SHARED_KV_TENSOR = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight")


def expected_hf_tensors(c: Gemma4Config) -> dict[str, tuple[int, ...]]:
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


class _CanonicalReader(_TensorReader):
    """A ``_TensorReader`` addressed by canonical names (``canonical -> on-disk`` in ``disk_names``)."""

    def __init__(self, files: dict[str, Path], disk_names: dict[str, str]):
        super().__init__(files)
        self._disk_names = disk_names

    def shape(self, name):
        return super().shape(self._disk_names[name])

    def dtype(self, name):
        return super().dtype(self._disk_names[name])

    def get(self, name):
        return super().get(self._disk_names[name])


def _canonical_names(disk: list[str], config: Gemma4Config) -> dict[str, str]:
    """canonical -> on-disk name for every tensor the text model may read."""
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


def load(path: Path, cfg: dict, *, dtype=None, progress: bool = False) -> Model:
    """Load a Gemma 4 checkpoint directory whose parsed ``config.json`` is ``cfg``."""
    config = gemma4_config_from_hf(cfg)
    files = _tensor_files(path)
    disk_names = _canonical_names(list(files), config)
    reader = _CanonicalReader(files, disk_names)
    try:
        _check_tensors(reader, set(disk_names), expected_hf_tensors(config), config.tie_word_embeddings)
        target = np.dtype(dtype) if dtype is not None else np.dtype(reader.get("model.embed_tokens.weight").dtype)

        def get(name, transpose=False):
            x = reader.get(name)
            return jnp.asarray((x.T if transpose else x).astype(target))

        def fused(names):
            return jnp.concatenate([get(n, transpose=True) for n in names], axis=-1)

        layers = []
        for i in tqdm(range(config.num_layers), desc="layers", disable=not progress):
            p = f"model.layers.{i}."
            owns_kv = config.kv_source(i) == i
            projections = ["q", "k", "v"] if owns_kv and config.has_v_proj(i) else ["q", "k"] if owns_kv else ["q"]
            ple = config.hidden_size_per_layer_input > 0
            layers.append(
                Layer(
                    attn_norm=get(p + "input_layernorm.weight"),
                    qkv=fused([p + f"self_attn.{x}_proj.weight" for x in projections]),
                    q_norm=get(p + "self_attn.q_norm.weight"),
                    o=get(p + "self_attn.o_proj.weight", transpose=True),
                    post_attn_norm=get(p + "post_attention_layernorm.weight"),
                    mlp_norm=get(p + "pre_feedforward_layernorm.weight"),
                    gate_up=fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=get(p + "mlp.down_proj.weight", transpose=True),
                    post_mlp_norm=get(p + "post_feedforward_layernorm.weight"),
                    layer_scalar=get(p + "layer_scalar"),
                    k_norm=get(p + "self_attn.k_norm.weight") if owns_kv else None,
                    ple_gate=get(p + "per_layer_input_gate.weight", transpose=True) if ple else None,
                    ple_proj=get(p + "per_layer_projection.weight", transpose=True) if ple else None,
                    ple_norm=get(p + "post_per_layer_input_norm.weight") if ple else None,
                )
            )
        per_layer = None
        if config.hidden_size_per_layer_input:
            per_layer = PerLayerEmbedding(
                embed=get("model.embed_tokens_per_layer.weight"),
                projection=get("model.per_layer_model_projection.weight", transpose=True),
                norm=get("model.per_layer_projection_norm.weight"),
            )
        return Model(
            embed=get("model.embed_tokens.weight"),
            layers=tuple(layers),
            final_norm=get("model.norm.weight"),
            lm_head=None if config.tie_word_embeddings else get("lm_head.weight", transpose=True),
            ple=per_layer,
            config=config,
        )
    finally:
        reader.close()
