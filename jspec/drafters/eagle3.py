"""EAGLE-3: one draft layer over the concatenated target hidden states (REFERENCE §2.2).

Per draft row (token ``t`` at ``j+1``, hidden ``g`` at ``j``)::

    e = embed(t)                          # the target's table unless the head stores its own
    h = fc(g)   if g is the 3*H_t target feature concat   else g   (own recycled hidden)
    x = h + attn(cat(input_layernorm(e), hidden_norm(h)))          # q/k/v read 2H-wide rows
    x = x + mlp(post_attention_layernorm(x))
    logits_draft = lm_head(norm(x))       # reduced vocab; target id = i + d2t[i]
    recycled hidden = x                   # pre-norm

The layer uses the head's own RoPE settings. Captured target layers: HF ``hidden_states``
indices (input of layer i), default ``[2, L//2, L-3]`` resolved by :meth:`Eagle3.bind`.

Usage::

    head = jspec.load_hf("EAGLE3-LLaMA3.1-Instruct-8B")      # -> Eagle3Head
    jspec.speculative_generate(target, jspec.drafters.Eagle3(head), prompts, 64)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jspec.config import LlamaConfig
from jspec.drafters._head import HiddenStateDrafter, require_llama_target
from jspec.layers import linear, rms_norm
from jspec.models.llama import Layer, Model, init_layer, random_matrix, random_norm_weight


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layer: LlamaConfig  # the midlayer (own RoPE); vocab_size = the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None = None  # HF hidden_states indices; None = [2, L//2, L-3]
    num_aux: int = 3

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Head:
    """EAGLE-3 parameters; linear weights ``[in, out]``."""

    fc: jax.Array  # [num_aux * H_t, H]
    hidden_norm: jax.Array  # [H]   midlayer.hidden_norm (on fc output / recycled hidden)
    layer: Layer  # attn_norm = midlayer.input_layernorm (on the embedding); qkv [2H, q + 2kv]
    norm: jax.Array  # [H]
    lm_head: jax.Array  # [H, V_d]
    d2t: jax.Array | None  # [V_d] int32 offsets: target id = i + d2t[i]; None when V_d == V
    embed: jax.Array | None  # [V, H] own embedding, None = the target's
    fc_bias: jax.Array | None = None  # [H]
    fc_norm: tuple[jax.Array, ...] | None = None  # SpecForge fc_norm: one [H_t] norm per chunk
    config: Eagle3Config = dataclasses.field(default=None, metadata=dict(static=True))


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3(HiddenStateDrafter):
    """EAGLE-3 drafter (API): ``Eagle3(head)``; ``bind(target)`` (done by
    ``speculative_generate``) attaches the target's embedding and resolves the captured layers."""

    head: Eagle3Head
    embed: jax.Array | None = None  # the target's table, set by bind when the head has none
    aux_layers: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))
    impl: str = dataclasses.field(default="auto", metadata=dict(static=True))

    # --- protocol ---------------------------------------------------------------------

    @property
    def capture(self) -> tuple[int, ...]:
        layers = self.aux_layers if self.aux_layers is not None else self.head.config.aux_layers
        if layers is None:
            raise ValueError("Eagle3: the captured target layers depend on the target's depth; call drafter.bind(target)")
        return tuple(layers)

    def check_compatible(self, target: Model) -> None:
        require_llama_target(target, "EAGLE-3")
        hc, tc = self.head.config, target.config
        if hc.layer.vocab_size != tc.vocab_size:
            raise ValueError(f"EAGLE-3 head vocab_size {hc.layer.vocab_size} != target vocab_size {tc.vocab_size}")
        layers = self.aux_layers or hc.aux_layers or default_aux_layers(tc.num_layers)
        bad = [i for i in layers if not 0 <= i < tc.num_layers]
        if bad:
            raise ValueError(
                f"EAGLE-3 aux hidden-state layer ids {list(layers)} are out of range for a target with "
                f"{tc.num_layers} layers (valid: 0..{tc.num_layers - 1}, HF hidden_states indexing)"
            )
        fc_in = self.head.fc.shape[0]
        if fc_in != len(layers) * tc.hidden_size:
            raise ValueError(
                f"EAGLE-3 fc.weight takes {fc_in} inputs but the target gives {len(layers)} x hidden_size "
                f"{tc.hidden_size} = {len(layers) * tc.hidden_size} (wrong fc width for this target)"
            )
        if self.head.embed is None and target.embed.shape[1] != hc.hidden_size:
            raise ValueError(
                f"EAGLE-3 head has no embed_tokens and its hidden_size {hc.hidden_size} != the target's "
                f"embedding width {target.embed.shape[1]}"
            )

    def bind(self, target: Model) -> Eagle3:
        self.check_compatible(target)
        layers = self.aux_layers or self.head.config.aux_layers or default_aux_layers(target.config.num_layers)
        return dataclasses.replace(
            self, embed=None if self.head.embed is not None else target.embed, aux_layers=tuple(layers)
        )

    # --- HiddenStateDrafter hooks -----------------------------------------------------

    @property
    def _layer(self) -> Layer:
        return self.head.layer

    @property
    def _layer_config(self) -> LlamaConfig:
        return self.head.config.layer

    def _embedding(self):
        table = self.head.embed if self.head.embed is not None else self.embed
        if table is None:
            raise ValueError("Eagle3: the head has no embedding; call drafter.bind(target) first")
        return table

    def fc(self, g):
        """``[..., num_aux * H_t]`` target features -> ``[..., H]``."""
        head, eps = self.head, self._layer_config.rms_norm_eps
        g = g.astype(head.fc.dtype)
        if head.fc_norm is not None:
            chunks = jnp.split(g, len(head.fc_norm), axis=-1)
            g = jnp.concatenate([rms_norm(x, w, eps) for x, w in zip(chunks, head.fc_norm)], axis=-1)
        return linear(g, head.fc, head.fc_bias, impl=self.impl)

    def _layer_inputs(self, tokens, g, from_target: bool):
        eps = self._layer_config.rms_norm_eps
        e = self._embedding()[tokens].astype(self.head.norm.dtype)
        h = self.fc(g) if from_target else g
        attn_in = jnp.concatenate([rms_norm(e, self.head.layer.attn_norm, eps), rms_norm(h, self.head.hidden_norm, eps)], -1)
        return h, attn_in

    def _recycle(self, x):
        return x

    def _logits(self, x):
        h = rms_norm(x, self.head.norm, self._layer_config.rms_norm_eps)
        return linear(h, self.head.lm_head, impl=self.impl).astype(jnp.float32)

    def _to_target(self, ids):
        return ids if self.head.d2t is None else ids + self.head.d2t[ids]

    def _draft_vocab_to_target(self, logits):
        if self.head.d2t is None:
            return logits
        vocab = self._layer_config.vocab_size
        hot = jnp.arange(logits.shape[-1], dtype=jnp.int32) + self.head.d2t
        full = jnp.full(logits.shape[:-1] + (vocab,), -jnp.inf, logits.dtype)
        return full.at[..., hot].set(logits)

    def _target_features(self, features):
        return jnp.concatenate(features, axis=-1)


def init_eagle3_head(
    config: Eagle3Config, key, dtype=jnp.float32, *, scale: float = 0.02, own_embed: bool = False, fc_bias: bool = False
) -> Eagle3Head:
    """Random EAGLE-3 parameters generated where jax runs (tests, benchmarks).

    ``d2t`` maps the draft vocab onto a random sorted subset of the target vocab when
    ``draft_vocab_size < vocab_size``.
    """
    c = config.layer
    H = c.hidden_size
    k = jax.random.split(key, 8)
    normal = functools.partial(random_matrix, dtype=dtype, scale=scale)
    norm = functools.partial(random_norm_weight, dtype=dtype)

    d2t = None
    if config.draft_vocab_size < c.vocab_size:
        hot = jnp.sort(jax.random.permutation(k[0], c.vocab_size)[: config.draft_vocab_size])
        d2t = (hot - jnp.arange(config.draft_vocab_size)).astype(jnp.int32)
    return Eagle3Head(
        fc=normal(k[1], (config.num_aux * config.target_hidden_size, H)),
        hidden_norm=norm(k[2], (H,)),
        layer=init_layer(c, k[3], dtype, scale=scale, in_size=2 * H),
        norm=norm(k[4], (H,)),
        lm_head=normal(k[5], (H, config.draft_vocab_size)),
        d2t=d2t,
        embed=normal(k[6], (c.vocab_size, H)) if own_embed else None,
        fc_bias=normal(k[7], (H,)) if fc_bias else None,
        config=config,
    )
