"""MTP / NextN: one extra decoder layer of the target's own type (DeepSeek-V3, arXiv:2412.19437; Qwen3-Next).

Per draft row (token ``t`` at ``j+1``, hidden ``g`` at ``j``)::

    x  = eh_proj(cat(enorm(embed(t)), hnorm(g)))     # ORDER: embedding first
    x  = decoder_layer(x)                             # the target's layer type, own KV cache
    h' = norm(x)                                      # shared_head.norm / mtp.norm
    logits = lm_head(h')                              # the target's LM head

As in vllm-project/vllm ``vllm/model_executor/models/deepseek_mtp.py`` and ``qwen3_next_mtp.py``,
SGLang ``python/sglang/srt/models/deepseek_nextn.py`` and transformers ``MtpLayer``.

Embedding and LM head are the target's (attached by :meth:`MTP.bind`). One MTP layer is
chained for ``k > 1`` drafts, recycling its own hidden.

Hidden-state conventions where public implementations disagree are options:

* ``input_hidden``: the target hidden the first step reads -- ``"post_norm"`` (default:
  transformers ``hidden_states[-1]``, vLLM, SGLang) or ``"pre_norm"`` (llama.cpp's DeepSeek
  reading, mlx-lm for Qwen3.5).
* ``recycled_hidden``: what steps >= 2 feed back -- ``"post_norm"`` (default, ``h'``:
  SGLang, current vLLM) or ``"pre_norm"`` (``x``: older vLLM).

All RMSNorms follow the target family's formula (``w * x_hat``). Real Qwen3-Next / Qwen3.5
MTP modules use zero-centred ``(1 + w)`` norms and gated attention, but those targets are
hybrid models jspec does not run; the ``mtp.*`` layout is read here for dense targets.

Checkpoints: the MTP tensors live inside the *target* checkpoint (``jspec.load_hf`` skips
them, as transformers does). Two layouts: DeepSeek-V3 ``model.layers.{L}.{enorm, hnorm,
eh_proj, shared_head.norm, <decoder layer>}`` (``L = num_hidden_layers``; the duplicated
``embed_tokens`` / ``shared_head.head`` are skipped) and Qwen3-Next / Qwen3.5 ``mtp.{fc,
pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layers.0.<decoder layer>}``. :func:`save_head`
writes a (trained) head in the DeepSeek layout. Usage::

    target = jspec.load_hf(path)
    drafter = jspec.drafters.MTP.load(path)  # the MTP tensors of the same checkpoint
    jspec.speculative_generate(target, drafter, prompts, 64)
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters.hidden_state import HiddenStateDrafter, require_llama_target
from jspec.execution import DEFAULT, Execution
from jspec.parallel import COLUMN, ROW, TensorParallel, split
from jspec.io.orbax import write_hf_directory
from jspec.io.safetensors import TensorReader, check_tensors, checkpoint_dtype, read_json, tensor_files
from jspec.layers import embedding, linear, rms_norm
from jspec.models.base import Capture, lm_head, random_matrix, random_norm_weight
from jspec.models.llama import Layer, LlamaConfig, Model, from_hf_config, init_layer, to_hf_config
from jspec.models.llama.weights import layer_arrays, layer_tensors, read_layer
from jspec.quant import MATMUL_WEIGHT, TABLE_WEIGHT

_HIDDEN_CHOICES = ("post_norm", "pre_norm")
# Fields of the target config the MTP block depends on.
_BLOCK_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "rope_scaling", "qkv_bias", "qk_norm",
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPHead:
    """One MTP module; linear weights ``[in, out]``. ``config``: the target's config."""

    enorm: jax.Array  # [H]   on the token embedding   (mtp.pre_fc_norm_embedding)
    hnorm: jax.Array  # [H]   on the previous hidden   (mtp.pre_fc_norm_hidden)
    eh_proj: jax.Array = dataclasses.field(metadata=MATMUL_WEIGHT)  # [2H, H]   (mtp.fc)
    layer: Layer  # the decoder block, target layer type
    norm: jax.Array  # [H]   shared_head.norm / mtp.norm
    config: LlamaConfig = dataclasses.field(default=None, metadata=dict(static=True))
    layout: str = dataclasses.field(default="deepseek", metadata=dict(static=True))  # or "qwen3_next"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTP(HiddenStateDrafter):
    """MTP drafter (API): ``MTP(head, input_hidden=..., recycled_hidden=...)``."""

    head: MTPHead
    embed: jax.Array | None = split(ROW, metadata=TABLE_WEIGHT, default=None)  # the target's, set by bind
    lm_head: jax.Array | None = split(COLUMN, metadata=MATMUL_WEIGHT, default=None)  # the target's ([H, V]); None with embed set = tied
    input_hidden: str = dataclasses.field(default="post_norm", metadata=dict(static=True))
    recycled_hidden: str = dataclasses.field(default="post_norm", metadata=dict(static=True))
    # The target's kernels, set by bind (one impl= for target and drafter); never a placement.
    execution: Execution = dataclasses.field(default=DEFAULT, metadata=dict(static=True))
    # The target's placement of ``embed`` / ``lm_head``, set by bind: their lookups and logits run per device.
    table_placement: TensorParallel | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        for name in ("input_hidden", "recycled_hidden"):
            if getattr(self, name) not in _HIDDEN_CHOICES:
                raise ValueError(f"MTP {name} must be one of {_HIDDEN_CHOICES}, got {getattr(self, name)!r}")

    @classmethod
    def load(cls, path, *, dtype=None, **options) -> MTP:
        """The drafter from the MTP layer stored in the target checkpoint directory ``path``;
        ``options``: ``input_hidden``, ``recycled_hidden``."""
        return cls(load_head(path, dtype=dtype), **options)

    # --- protocol ---------------------------------------------------------------------

    @property
    def capture(self) -> Capture:
        if self.input_hidden == "post_norm":
            return Capture(final_normed=True)
        return Capture(residuals=(self.head.config.num_layers,))

    def max_positions(self) -> None:
        return None  # positions are the target's; RoPE has no hard limit

    def check_compatible(self, target: Model) -> None:
        require_llama_target(target, "MTP")
        hc, tc = self.head.config, target.config
        diff = [f for f in _BLOCK_FIELDS if getattr(hc, f) != getattr(tc, f)]
        if diff:
            detail = ", ".join(f"{f}: head {getattr(hc, f)!r} vs target {getattr(tc, f)!r}" for f in diff)
            raise ValueError(f"MTP head does not match the target ({detail})")
        if hc.num_layers != tc.num_layers and self.input_hidden == "pre_norm":
            raise ValueError(f"MTP head was loaded for a {hc.num_layers}-layer target, this one has {tc.num_layers}")

    def bind(self, target: Model) -> MTP:
        self.check_compatible(target)
        return dataclasses.replace(self, embed=target.embed, lm_head=target.lm_head,
                                   execution=Execution(target.execution.kernels),
                                   table_placement=target.execution.placement)

    # --- HiddenStateDrafter hooks -----------------------------------------------------

    @property
    def layer(self) -> Layer:
        return self.head.layer

    @property
    def layer_config(self) -> LlamaConfig:
        return self.head.config

    def layer_inputs(self, tokens, g, from_target: bool):
        if self.embed is None:
            raise ValueError("MTP: call drafter.bind(target) first (it shares the target's embedding and LM head)")
        eps, head = self.head.config.rms_norm_eps, self.head
        e = embedding(self.embed, tokens, self.table_placement).astype(head.norm.dtype)
        g = g.astype(head.norm.dtype)
        normed = [rms_norm(e, head.enorm, eps, self.execution), rms_norm(g, head.hnorm, eps, self.execution)]
        x = linear(jnp.concatenate(normed, -1), head.eh_proj, None, self.execution)
        return x, rms_norm(x, self.layer.attn_norm, self.layer_config.rms_norm_eps, self.execution)

    def recycle(self, x):
        if self.recycled_hidden == "pre_norm":
            return x
        return rms_norm(x, self.head.norm, self.head.config.rms_norm_eps, self.execution)

    def head_logits(self, x):
        h = rms_norm(x, self.head.norm, self.head.config.rms_norm_eps, self.execution)
        return lm_head(self.embed, self.lm_head, h, dataclasses.replace(self.execution, placement=self.table_placement))

    def to_target(self, ids):
        return ids

    def draft_vocab_to_target(self, logits):
        return logits

    def target_features(self, features):
        return features[0]


def init_mtp_head(target_config: LlamaConfig, key, dtype=jnp.float32, *, scale: float = 0.02) -> MTPHead:
    """Random MTP parameters for ``target_config`` (tests, benchmarks)."""
    c = target_config
    H = c.hidden_size
    k = jax.random.split(key, 5)
    return MTPHead(
        enorm=random_norm_weight(k[0], (H,), dtype),
        hnorm=random_norm_weight(k[1], (H,), dtype),
        eh_proj=random_matrix(k[2], (2 * H, H), dtype, scale),
        layer=init_layer(c, k[3], dtype, scale=scale, in_size=H),
        norm=random_norm_weight(k[4], (H,), dtype),
        config=c,
    )


# ---------------------------------------------------------------------------------------
# checkpoints


def _mtp_candidate(name: str, num_layers: int) -> bool:
    if name.startswith("mtp."):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= num_layers


def load_head(path, *, dtype=None) -> MTPHead:
    """Load the MTP / NextN module stored in the target checkpoint directory ``path``.

    Exactly one MTP layer is supported (it is chained for k > 1 drafts).
    """
    path = Path(path)
    cfg = read_json(path / "config.json")
    config = from_hf_config(cfg)
    L, H = config.num_layers, config.hidden_size
    files = tensor_files(path)
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
    expected |= layer_tensors(config, layer_prefix)
    with TensorReader(files) as reader:
        check_tensors(reader, mtp_names - skip, expected)
        get = reader.getter(checkpoint_dtype(reader, head_names["eh_proj"], dtype))
        return MTPHead(
            enorm=jnp.asarray(get(head_names["enorm"])),
            hnorm=jnp.asarray(get(head_names["hnorm"])),
            eh_proj=jnp.asarray(get(head_names["eh_proj"], True)),
            layer=read_layer(get, config, layer_prefix),
            norm=jnp.asarray(get(head_names["norm"])),
            config=config,
            layout=layout,
        )


def save_head(head: MTPHead, path, *, metadata: dict | None = None) -> None:
    """Write ``head`` as the MTP layer of a DeepSeek-V3-layout checkpoint: ``config.json`` (the
    target's HF config with ``num_nextn_predict_layers: 1``; ``metadata``, e.g. how it was trained,
    under ``"jspec"``) and ``model.safetensors`` holding ``model.layers.{L}.{enorm, hnorm, eh_proj,
    shared_head.norm, <decoder layer>}`` with ``L = num_hidden_layers``: the index right after the
    target's own layers, where DeepSeek-V3 keeps its MTP layer. :meth:`MTP.load` reads it back
    exactly (in the DeepSeek layout, whichever layout the head was loaded from). Written atomically.

    Only the MTP tensors are written: the embedding and LM head are the target's (:meth:`MTP.bind`
    attaches them), so DeepSeek-V3's per-layer copies (``embed_tokens``, ``shared_head.head``) would
    add two ``[V, H]`` matrices and nothing else. The file can therefore join the target's own
    weights -- beside a single-file checkpoint under another name (``mtp.safetensors``), its tensors
    added to ``model.safetensors.index.json`` in a sharded one -- with ``num_nextn_predict_layers: 1``
    in the target's ``config.json`` so that the target's loaders skip them.
    """
    c = head.config
    p = f"model.layers.{c.num_layers}."
    tensors = {p + "enorm.weight": head.enorm, p + "hnorm.weight": head.hnorm, p + "eh_proj.weight": head.eh_proj.T,
               p + "shared_head.norm.weight": head.norm} | layer_arrays(head.layer, c, p)
    hf = to_hf_config(c) | dict(num_nextn_predict_layers=1, torch_dtype=np.dtype(head.eh_proj.dtype).name)
    write_hf_directory(path, hf, tensors, metadata=metadata)
