"""HF checkpoints of hidden-state drafters: EAGLE-3 heads and MTP / NextN modules.

* EAGLE-3 (``architectures: ["LlamaForCausalLMEagle3"]``): its own directory;
  ``jspec.load_hf(path)`` dispatches here and returns an :class:`Eagle3Head` for
  ``jspec.drafters.Eagle3(head)``. Tensor names with or without a ``model.`` prefix.
* MTP: stored inside the *target* checkpoint, so ``jspec.load_hf(path)`` returns the target
  (ignoring the MTP tensors, as transformers does) and ``jspec.load_hf_mtp(path)`` returns
  the :class:`MTPHead` for ``jspec.drafters.MTP(head)``. Two layouts:
  DeepSeek-V3 ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,<decoder layer>}``
  (``L = num_hidden_layers``; the duplicated ``embed_tokens`` / ``shared_head.head`` are
  skipped) and Qwen3-Next / Qwen3.5 ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm,
  layers.0.<decoder layer>}``. The decoder layer has the target's layer type.

Every loader checks the full tensor set (missing, unexpected, mis-shaped) before reading data
and raises ``ValueError`` naming the problem.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jspec.checkpoint import _check_tensors, _read_json, _tensor_files, _TensorReader, expected_hf_tensors
from jspec.config import LlamaConfig, llama_config_from_hf
from jspec.drafters.eagle3 import Eagle3Config, Eagle3Head
from jspec.drafters.mtp import MTPHead
from jspec.models.llama import Layer

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def is_eagle3_config(cfg: dict) -> bool:
    return any(a in EAGLE3_ARCHITECTURES for a in cfg.get("architectures") or [])


# ---------------------------------------------------------------------------------------
# decoder layer tensors


def _layer_tensors(c: LlamaConfig, prefix: str, in_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Expected tensors of one decoder layer under ``prefix`` (q/k/v read ``in_size`` columns)."""
    one = dataclasses.replace(c, num_layers=1)
    shapes = {
        prefix + name[len("model.layers.0.") :]: shape
        for name, shape in expected_hf_tensors(one).items()
        if name.startswith("model.layers.0.")
    }
    if in_size is not None:
        for x in "qkv":
            name = prefix + f"self_attn.{x}_proj.weight"
            shapes[name] = (shapes[name][0], in_size)
    return shapes


def _read_layer(get, c: LlamaConfig, p: str) -> Layer:
    def fused(names):
        return jnp.asarray(np.concatenate([get(n, True) for n in names], axis=-1))

    return Layer(
        attn_norm=jnp.asarray(get(p + "input_layernorm.weight")),
        qkv=fused([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
        o=jnp.asarray(get(p + "self_attn.o_proj.weight", True)),
        mlp_norm=jnp.asarray(get(p + "post_attention_layernorm.weight")),
        gate_up=fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
        down=jnp.asarray(get(p + "mlp.down_proj.weight", True)),
        qkv_bias=(
            jnp.asarray(np.concatenate([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])) if c.qkv_bias else None
        ),
        q_norm=jnp.asarray(get(p + "self_attn.q_norm.weight")) if c.qk_norm else None,
        k_norm=jnp.asarray(get(p + "self_attn.k_norm.weight")) if c.qk_norm else None,
    )


class _Renamed(_TensorReader):
    """A reader addressed by canonical names (on-disk names with a prefix stripped)."""

    def __init__(self, files, rename):
        super().__init__({rename(n): f for n, f in files.items()})
        self._disk = {rename(n): n for n in files}

    def shape(self, name):
        return tuple(self._handle(name).get_slice(self._disk[name]).get_shape())

    def get(self, name):
        return self._handle(name).get_tensor(self._disk[name])


def _getter(reader, dtype):
    def get(name, transpose=False):
        x = reader.get(name)
        return (x.T if transpose else x).astype(dtype)

    return get


# ---------------------------------------------------------------------------------------
# EAGLE-3


def _aux_layers(cfg: dict) -> tuple[int, ...] | None:
    """Captured target layers in HF ``hidden_states`` indexing (REFERENCE §8 item 7)."""
    if cfg.get("aux_layers_hf_index") is not None:  # jspec's canonical field
        ids = [int(i) for i in cfg["aux_layers_hf_index"]]
    elif (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") is not None:
        # SGLang / SpecForge: ids of the layers whose *output* is taken -> +1.
        ids = [int(i) + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    elif cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
        # vLLM speculators: input-of-layer ids, as HF hidden_states.
        ids = [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    else:
        return None
    if not ids or any(i < 0 for i in ids):
        raise ValueError(f"EAGLE-3 aux hidden-state layer ids {ids} are out of range (must be >= 0)")
    return tuple(ids)


def eagle3_config_from_hf(cfg: dict) -> Eagle3Config:
    layers = cfg.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"unsupported EAGLE-3 config field num_hidden_layers={layers} (supported: 1)")
    if cfg.get("norm_output"):
        raise ValueError("unsupported EAGLE-3 config field norm_output=True")
    layer_cfg = dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
    layer = llama_config_from_hf(layer_cfg)
    draft_vocab = int(cfg.get("draft_vocab_size") or layer.vocab_size)
    if draft_vocab > layer.vocab_size:
        raise ValueError(f"EAGLE-3 draft_vocab_size {draft_vocab} > vocab_size {layer.vocab_size}")
    aux = _aux_layers(cfg)
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(cfg.get("target_hidden_size") or layer.hidden_size),
        aux_layers=aux,
        num_aux=len(aux) if aux is not None else 3,
    )


def load_eagle3(path, *, dtype=None, cfg: dict | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head directory (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``)."""
    path = Path(path)
    cfg = _read_json(path / "config.json") if cfg is None else cfg
    config = eagle3_config_from_hf(cfg)
    c, H, V, Vd = config.layer, config.hidden_size, config.layer.vocab_size, config.draft_vocab_size
    files = _tensor_files(path)
    reader = _Renamed(files, lambda n: n[len("model.") :] if n.startswith("model.") else n)
    names = set(reader._disk)
    expected = {
        "fc.weight": (H, config.num_aux * config.target_hidden_size),
        "midlayer.hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
    }
    expected |= _layer_tensors(c, "midlayer.", in_size=2 * H)
    if Vd != V:
        for name, shape in (("d2t", (Vd,)), ("t2d", (V,))):
            if name not in names:
                raise ValueError(
                    f"EAGLE-3 checkpoint is missing {name!r}: draft_vocab_size {Vd} != vocab_size {V} needs the "
                    "draft-to-target vocabulary map"
                )
    for name, shape in (("d2t", (Vd,)), ("t2d", (V,)), ("fc.bias", (H,)), ("embed_tokens.weight", (V, H))):
        if name in names:
            expected[name] = shape
    if cfg.get("fc_norm"):
        expected |= {f"fc_norm.{i}.weight": (config.target_hidden_size,) for i in range(config.num_aux)}
    try:
        _check_tensors(reader, names, expected, tied=False)
        target = np.dtype(dtype) if dtype is not None else np.dtype(reader.get("fc.weight").dtype)
        get = _getter(reader, target)
        d2t = None
        if "d2t" in names:
            d2t = reader.get("d2t").astype(np.int64)
            hot = np.arange(Vd) + d2t
            if hot.min() < 0 or hot.max() >= V:
                raise ValueError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary [0, {V})")
            d2t = jnp.asarray(d2t.astype(np.int32))
        return Eagle3Head(
            fc=jnp.asarray(get("fc.weight", True)),
            hidden_norm=jnp.asarray(get("midlayer.hidden_norm.weight")),
            layer=_read_layer(get, c, "midlayer."),
            norm=jnp.asarray(get("norm.weight")),
            lm_head=jnp.asarray(get("lm_head.weight", True)),
            d2t=d2t,
            embed=jnp.asarray(get("embed_tokens.weight")) if "embed_tokens.weight" in names else None,
            fc_bias=jnp.asarray(get("fc.bias")) if "fc.bias" in names else None,
            fc_norm=(
                tuple(jnp.asarray(get(f"fc_norm.{i}.weight")) for i in range(config.num_aux))
                if cfg.get("fc_norm")
                else None
            ),
            config=config,
        )
    finally:
        reader.close()


# ---------------------------------------------------------------------------------------
# MTP


def num_mtp_layers(cfg: dict) -> int:
    """MTP layers a target config declares (DeepSeek ``num_nextn_predict_layers``, Qwen3-Next /
    Qwen3.5 ``mtp_num_hidden_layers``)."""
    return int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)


def _mtp_candidate(name: str, num_layers: int) -> bool:
    if name.startswith("mtp."):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= num_layers


def is_mtp_tensor(name: str, cfg: dict) -> bool:
    """Tensors of the MTP layers a target config declares (``load_hf`` skips them, as transformers
    does); without a declaration nothing is skipped, so stray tensors still fail the load."""
    n = num_mtp_layers(cfg)
    if n == 0:
        return False
    if name.startswith("mtp."):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    L = int(cfg.get("num_hidden_layers", 0))
    return m is not None and L <= int(m.group(1)) < L + n


def load_hf_mtp(path, *, dtype=None) -> MTPHead:
    """Load the MTP / NextN module stored in the target checkpoint directory ``path``.

    Returns an :class:`MTPHead` for ``jspec.drafters.MTP(head)``. Exactly one MTP layer is
    supported (it is chained for k > 1 drafts).
    """
    path = Path(path)
    cfg = _read_json(path / "config.json")
    config = llama_config_from_hf(cfg)
    L, H = config.num_layers, config.hidden_size
    files = _tensor_files(path)
    mtp_names = {n for n in files if _mtp_candidate(n, L)}
    if any(n.startswith("mtp.") for n in mtp_names):
        layout, p = "qwen3_next", "mtp."
        extra_layers = sorted({m.group(1) for n in mtp_names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))} - {"0"})
        head_names = dict(enorm=p + "pre_fc_norm_embedding.weight", hnorm=p + "pre_fc_norm_hidden.weight",
                          eh_proj=p + "fc.weight", norm=p + "norm.weight")
        layer_prefix, skip = p + "layers.0.", set()
    elif f"model.layers.{L}.eh_proj.weight" in mtp_names:
        layout, p = "deepseek", f"model.layers.{L}."
        extra_layers = sorted({m.group(1) for n in mtp_names if (m := re.match(r"model\.layers\.(\d+)\.", n))} - {str(L)})
        head_names = dict(enorm=p + "enorm.weight", hnorm=p + "hnorm.weight", eh_proj=p + "eh_proj.weight",
                          norm=p + "shared_head.norm.weight")
        layer_prefix, skip = p, {p + "embed_tokens.weight", p + "shared_head.head.weight"}
    else:
        raise ValueError(
            f"{path} has no MTP layer (expected model.layers.{L}.eh_proj.weight (DeepSeek layout) "
            "or mtp.fc.weight (Qwen3-Next / Qwen3.5 layout))"
        )
    if extra_layers:
        raise ValueError(f"checkpoint has {1 + len(extra_layers)} MTP layers; only one is supported")
    expected = {head_names["eh_proj"]: (H, 2 * H)}
    expected |= {head_names[k]: (H,) for k in ("enorm", "hnorm", "norm")}
    expected |= _layer_tensors(config, layer_prefix)
    reader = _TensorReader(files)
    try:
        _check_tensors(reader, mtp_names - skip, expected, tied=False)
        target = np.dtype(dtype) if dtype is not None else np.dtype(reader.get(head_names["eh_proj"]).dtype)
        get = _getter(reader, target)
        return MTPHead(
            enorm=jnp.asarray(get(head_names["enorm"])),
            hnorm=jnp.asarray(get(head_names["hnorm"])),
            eh_proj=jnp.asarray(get(head_names["eh_proj"], True)),
            layer=_read_layer(get, config, layer_prefix),
            norm=jnp.asarray(get(head_names["norm"])),
            config=config,
            layout=layout,
        )
    finally:
        reader.close()
