"""MTP / NextN: one extra decoder layer of the target's own type (REFERENCE §2.3, §2.4).

Per draft row (token ``t`` at ``j+1``, hidden ``g`` at ``j``)::

    x  = eh_proj(cat(enorm(embed(t)), hnorm(g)))     # ORDER: embedding first
    x  = decoder_layer(x)                             # the target's layer type, own KV cache
    h' = norm(x)                                      # shared_head.norm / mtp.norm
    logits = lm_head(h')                              # the target's LM head

Embedding and LM head are the target's (attached by :meth:`MTP.bind`). One MTP layer is
chained for ``k > 1`` drafts, recycling its own hidden.

Hidden-state conventions (REFERENCE §8 items 3-5, where references disagree) are options:

* ``input_hidden``: the target hidden the first step reads -- ``"post_norm"`` (default:
  transformers ``hidden_states[-1]``, vLLM, SGLang) or ``"pre_norm"`` (llama.cpp's DeepSeek
  reading, mlx-lm for Qwen3.5).
* ``recycled_hidden``: what steps >= 2 feed back -- ``"post_norm"`` (default, ``h'``:
  SGLang, current vLLM) or ``"pre_norm"`` (``x``: older vLLM).

All RMSNorms follow the target family's formula (``w * x_hat``). Real Qwen3-Next / Qwen3.5
MTP modules use zero-centred ``(1 + w)`` norms and gated attention, but those targets are
hybrid models jspec does not run; the ``mtp.*`` layout is read here for dense targets.

Usage::

    target = jspec.load_hf(path)
    head = jspec.load_hf_mtp(path)           # the MTP tensors of the same checkpoint
    jspec.speculative_generate(target, jspec.drafters.MTP(head), prompts, 64)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config import LlamaConfig
from jspec.drafters._head import HiddenStateDrafter, require_llama_target
from jspec.layers import linear, rms_norm
from jspec.models.llama import FINAL_NORMED, Layer, Model, init_layer, random_matrix, random_norm_weight

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
    eh_proj: jax.Array  # [2H, H]                      (mtp.fc)
    layer: Layer  # the decoder block, target layer type
    norm: jax.Array  # [H]   shared_head.norm / mtp.norm
    config: LlamaConfig = dataclasses.field(default=None, metadata=dict(static=True))
    layout: str = dataclasses.field(default="deepseek", metadata=dict(static=True))  # or "qwen3_next"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTP(HiddenStateDrafter):
    """MTP drafter (API): ``MTP(head, input_hidden=..., recycled_hidden=...)``."""

    head: MTPHead
    embed: jax.Array | None = None  # the target's, set by bind
    lm_head: jax.Array | None = None  # the target's ([H, V]); None with embed set = tied
    input_hidden: str = dataclasses.field(default="post_norm", metadata=dict(static=True))
    recycled_hidden: str = dataclasses.field(default="post_norm", metadata=dict(static=True))
    impl: str = dataclasses.field(default="auto", metadata=dict(static=True))

    def __post_init__(self):
        for name in ("input_hidden", "recycled_hidden"):
            if getattr(self, name) not in _HIDDEN_CHOICES:
                raise ValueError(f"MTP {name} must be one of {_HIDDEN_CHOICES}, got {getattr(self, name)!r}")

    # --- protocol ---------------------------------------------------------------------

    @property
    def capture(self):
        return (FINAL_NORMED,) if self.input_hidden == "post_norm" else (self.head.config.num_layers,)

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
        return dataclasses.replace(self, embed=target.embed, lm_head=target.lm_head)

    # --- HiddenStateDrafter hooks -----------------------------------------------------

    @property
    def _layer(self) -> Layer:
        return self.head.layer

    @property
    def _layer_config(self) -> LlamaConfig:
        return self.head.config

    def _layer_inputs(self, tokens, g, from_target: bool):
        if self.embed is None:
            raise ValueError("MTP: call drafter.bind(target) first (it shares the target's embedding and LM head)")
        eps, head = self.head.config.rms_norm_eps, self.head
        e = self.embed[tokens].astype(head.norm.dtype)
        g = g.astype(head.norm.dtype)
        x = linear(jnp.concatenate([rms_norm(e, head.enorm, eps), rms_norm(g, head.hnorm, eps)], -1), head.eh_proj, impl=self.impl)
        return x, None

    def _recycle(self, x):
        if self.recycled_hidden == "pre_norm":
            return x
        return rms_norm(x, self.head.norm, self.head.config.rms_norm_eps)

    def _logits(self, x):
        h = rms_norm(x, self.head.norm, self.head.config.rms_norm_eps)
        if self.lm_head is None:
            return jnp.einsum("...h,vh->...v", h, self.embed, preferred_element_type=jnp.float32)
        return linear(h, self.lm_head, impl=self.impl).astype(jnp.float32)

    def _to_target(self, ids):
        return ids

    def _draft_vocab_to_target(self, logits):
        return logits

    def _target_features(self, features):
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
