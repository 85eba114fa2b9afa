"""The Gemma 4 assistant as pure functions: its parameters, one forward step over the target's
frozen K/V, and its two LM heads (HF transformers ``Gemma4AssistantForCausalLM``).

One step, for a token ``t`` and a hidden ``h`` in the target's space (width ``H_b``)::

    x = pre_projection(cat(target_embed(t) * sqrt(H_b), h))      # scale in the table's dtype
    x = Gemma 4 decoder layers, Q-only: each attends to the target's cached K/V of the last
        non-shared target layer of its own type (computes no K/V, writes nothing)
    y = final_norm(x)                                             # assistant space (H_a)
    logits = tied head (y @ embed.T)  or  centroid head (below)
    h' = post_projection(y)                                       # the next step's h

The decoder layers are Gemma 4's own (``jspec.models.gemma4.decoder_layer``): the assistant's
text model is a ``gemma4.Model`` whose every layer is KV-shared, so its attention reads the
buffers it is handed. Its ``embed`` is the tied LM head, never an input embedding.

Centroid ("masked embedding", transformers ``Gemma4AssistantMaskedEmbedder``) head: the top
``centroid_top_k`` of ``num_centroids`` cluster scores pick ``centroid_top_k * V / num_centroids``
candidate tokens (``token_ordering`` lists each cluster's token ids); only those get a logit.
transformers fills the others with ``min(candidate logits) - 1`` (over the whole batch; here per
row, the same at batch 1 and for the argmax); when drafts are sampled they get ``-inf``
(probability zero).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jspec.execution import DEFAULT, Execution
from jspec.layers import Residual, add_norm, linear
from jspec.models import gemma4
from jspec.models.base import lm_head, random_matrix
from jspec.models.gemma4 import FULL, SLIDING, Gemma4Config
from jspec.models.gemma4.model import decoder_layer, embed_tokens
from jspec.quant import MATMUL_WEIGHT
from jspec.rope import rope_cos_sin
from jspec.step import Step
from pallas_kernels.norm.gather_rows import FP32_SCALE


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """``text``: the assistant's decoder, every layer KV-shared; ``backbone_hidden_size``: the
    target's hidden width ``H_b``; ``num_centroids`` set = the centroid head, None = tied head."""

    text: Gemma4Config
    backbone_hidden_size: int
    num_centroids: int | None = None
    centroid_top_k: int = 32

    def __post_init__(self):
        t = self.text
        if t.num_kv_shared_layers != t.num_layers:
            raise ValueError("every layer of a Gemma 4 assistant is KV-shared (num_kv_shared_layers == num_layers)")
        if t.hidden_size_per_layer_input or t.use_double_wide_mlp:
            raise ValueError("a Gemma 4 assistant has no per-layer embeddings and no double-wide MLP")
        if self.num_centroids is not None:
            if t.vocab_size % self.num_centroids:
                raise ValueError(f"vocab_size {t.vocab_size} is not a multiple of num_centroids {self.num_centroids}")
            if not 1 <= self.centroid_top_k <= self.num_centroids:
                raise ValueError(
                    f"centroid_intermediate_top_k {self.centroid_top_k} out of range for {self.num_centroids} centroids"
                )

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The layer types the assistant has, in first-use order."""
        return tuple(dict.fromkeys(self.text.layer_types))

    def head_dim(self, layer_type: str) -> int:
        return self.text.head_dim if layer_type == SLIDING else self.text.global_head_dim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Assistant:
    """Gemma 4 assistant parameters; linear weights ``[in, out]``."""

    pre_projection: jax.Array = dataclasses.field(metadata=MATMUL_WEIGHT)  # [2 * H_b, H_a]   (token embedding | hidden)
    model: gemma4.Model  # Q-only layers, final norm; embed [V, H_a] = the tied LM head
    post_projection: jax.Array = dataclasses.field(metadata=MATMUL_WEIGHT)  # [H_a, H_b]
    centroids: jax.Array | None = dataclasses.field(metadata=MATMUL_WEIGHT)  # [H_a, num_centroids]   masked_embedding.centroids
    token_ordering: jax.Array | None  # [num_centroids, V // num_centroids] int32 token ids per cluster
    config: AssistantConfig = dataclasses.field(metadata=dict(static=True))

    @property
    def dtype(self):
        return self.pre_projection.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrozenKV:
    """What the assistant reads of the target during one round; constant over its steps.

    Sequence ``b`` sees the target's committed rows ``j < lengths[b]``; a sliding layer only the
    last ``sliding_rows`` of them (ending at the last committed row ``lengths[b] - 1``).
    """

    k: dict[str, jax.Array]  # layer type -> the target's K buffer [batch, kv_heads, max_len, head_dim]
    v: dict[str, jax.Array]  # layer type -> the target's V buffer, same shape
    lengths: jax.Array  # [batch] committed target rows
    rope: dict[str, tuple[jax.Array, jax.Array]]  # layer type -> (cos, sin) [batch, 1, head_dim]
    sliding_rows: int = dataclasses.field(metadata=dict(static=True))


def frozen_kv(config: AssistantConfig, k_bufs, v_bufs, lengths, rope_positions, *, sliding_rows: int,
              dtype) -> FrozenKV:
    """The round's view: ``k_bufs`` / ``v_bufs`` map each assistant layer type to the target's
    buffers; ``rope_positions [batch]`` is the one RoPE position of every draft step."""
    positions = rope_positions.astype(jnp.int32)[:, None]
    rope = {}
    for kind in config.layer_kinds:
        inv_freq = jnp.asarray(config.text.rope(kind).inv_freq(config.head_dim(kind)))
        rope[kind] = rope_cos_sin(positions, inv_freq, dtype)
    return FrozenKV(k=dict(k_bufs), v=dict(v_bufs), lengths=lengths, rope=rope, sliding_rows=sliding_rows)


def assistant_step(assistant: Assistant, target_embed, tokens, hidden, kv: FrozenKV, ex: Execution = DEFAULT):
    """One assistant forward: ``tokens [batch]``, ``hidden [batch, H_b]`` (the target's final-normed
    hidden for the seed, the previous step's output after) -> ``(y [batch, H_a]`` final-normed,
    ``next hidden [batch, H_b])``. ``target_embed [V, H_b]``: the target's input embedding table.

    Branches of a draft tree: ``tokens [batch, r]`` and ``hidden [batch, r, H_b]`` run ``r``
    independent rows per sequence (outputs ``[batch, r, ...]``). They share the one frozen view
    of the target's cache as query rows of one attention call: nothing is replicated."""
    a, dtype = assistant, assistant.dtype
    branched = tokens.ndim == 2
    tokens, hidden = (tokens, hidden) if branched else (tokens[:, None], hidden[:, None])
    e = embed_tokens(target_embed, tokens).astype(dtype)
    x = linear(jnp.concatenate([e, hidden.astype(dtype)], axis=-1), a.pre_projection, None, ex)  # [batch, r, H_a]
    c = dataclasses.replace(a.model.config, sliding_window=kv.sliding_rows)
    # The mask is anchored at the last committed row, whatever the RoPE position; no row is written.
    anchor = jnp.broadcast_to((kv.lengths - 1)[:, None], tokens.shape)
    steps = {kind: Step(anchor, *rope, kv.lengths, execution=ex) for kind, rope in kv.rope.items()}
    # Each layer's last add also norms its output for the next layer, the last one's for the head.
    add = functools.partial(add_norm, eps=c.rms_norm_eps, ex=ex, rounding=FP32_SCALE)
    residual = Residual(x)
    for i, layer in enumerate(a.model.layers):
        kind = c.layer_types[i]
        x, y = add(residual, layer.attn_norm)
        residual, _ = decoder_layer(layer, c, i, x, y, (kv.k[kind], kv.v[kind]), steps[kind], None)
    _, y = add(residual, a.model.final_norm)
    y = y if branched else y[:, 0]
    return y, linear(y, a.post_projection, None, ex)


# --- heads -----------------------------------------------------------------------------


def centroid_candidates(assistant: Assistant, y):
    """The centroid head's candidates: ``(token ids [batch, S] int32, fp32 logits [batch, S])``,
    ``S = centroid_top_k * V / num_centroids``."""
    a = assistant
    scores = linear(y, a.centroids)  # [batch, num_centroids]
    top = top_k_indices(scores, a.config.centroid_top_k)
    ids = a.token_ordering[top].reshape(y.shape[0], -1)
    logits = jnp.einsum("bh,bsh->bs", y, a.model.embed[ids], preferred_element_type=jnp.float32)
    return ids, logits


def top_k_indices(scores, k: int):
    """``jax.lax.top_k(scores, k)[1]`` (ties: the lower index first) by counting instead of sorting:
    an entry's rank is the number of entries above it or tied with it at a lower index, and the
    top ``k`` are the entries of rank ``0 .. k-1``. ``scores [batch, n]`` -> ``[batch, k]`` int32.
    On the GPU XLA sorts all ``n`` entries for a top-k (for the assistant's centroid scores, its
    largest kernel after the attention); these two fused reductions over ``n x n`` comparisons
    take a launch each, and ``n`` is small."""
    n = scores.shape[-1]
    index = jnp.arange(n)
    other, this = scores[:, None, :], scores[:, :, None]  # [batch, i, j]: entry j against entry i
    ahead = (other > this) | ((other == this) & (index[None, :] < index[:, None]))
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)  # [batch, n]
    return jnp.argmax(rank[:, None, :] == jnp.arange(k)[:, None], axis=-1).astype(jnp.int32)


def assistant_logits(assistant: Assistant, y, *, masked: str = "min-1"):
    """fp32 logits ``[batch, V]`` of final-normed ``y [batch, H_a]``. Centroid head: tokens off
    the candidates get ``min - 1`` (``masked="min-1"``, transformers) or ``-inf`` (``"-inf"``)."""
    a = assistant
    if a.centroids is None:
        return lm_head(a.model.embed, None, y)
    ids, logits = centroid_candidates(a, y)
    if masked == "min-1":
        fill = jnp.min(logits, axis=-1, keepdims=True) - 1.0
    else:
        fill = jnp.full_like(logits[:, :1], -jnp.inf)
    full = jnp.broadcast_to(fill, (y.shape[0], a.config.vocab_size))
    return jax.vmap(lambda row, i, v: row.at[i].set(v))(full, ids, logits)


def greedy_token(assistant: Assistant, y):
    """``argmax`` of :func:`assistant_logits` ``[batch]`` int32; the centroid head takes it over
    its candidates only (ties: the smallest token id, as an argmax over the full vocabulary)."""
    a = assistant
    if a.centroids is None:
        return jnp.argmax(lm_head(a.model.embed, None, y), axis=-1).astype(jnp.int32)
    ids, logits = centroid_candidates(a, y)
    best = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.min(jnp.where(logits == best, ids, a.config.vocab_size), axis=-1).astype(jnp.int32)


# --- random parameters -----------------------------------------------------------------


def assistant_config(
    target: Gemma4Config,
    *,
    hidden_size: int,
    num_layers: int = 4,
    layer_types: tuple[str, ...] | None = None,
    num_heads: int | None = None,
    intermediate_size: int | None = None,
    num_centroids: int | None = None,
    centroid_top_k: int = 32,
) -> AssistantConfig:
    """An assistant shaped for ``target`` (tests, benchmarks): per layer type the target's head
    geometry, RoPE and window; layers ``[S, ..., S, F]`` unless given; ``num_heads`` the
    target's, ``intermediate_size`` ``8 * hidden_size`` (as the published E2B and 26B-A4B
    assistants) unless given."""
    layer_types = tuple(layer_types or (SLIDING,) * (num_layers - 1) + (FULL,))
    text = dataclasses.replace(
        target,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 8 * hidden_size,
        num_layers=len(layer_types),
        num_heads=num_heads or target.num_heads,
        layer_types=layer_types,
        final_logit_softcapping=None,
        tie_word_embeddings=True,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        num_kv_shared_layers=len(layer_types),
        use_double_wide_mlp=False,
        architecture="Gemma4ForCausalLM",
    )
    return AssistantConfig(text, target.hidden_size, num_centroids, centroid_top_k)


def init_assistant(config: AssistantConfig, key, dtype=jnp.float32, *, scale: float = 0.02) -> Assistant:
    """Random parameters (normal(0, scale) matrices, norms near 1; a random token ordering)."""
    c = config
    k_pre, k_model, k_post, k_cent, k_order = jax.random.split(key, 5)
    centroids = token_ordering = None
    if c.num_centroids is not None:
        centroids = random_matrix(k_cent, (c.hidden_size, c.num_centroids), dtype, scale)
        order = jax.random.permutation(k_order, c.vocab_size).astype(jnp.int32)
        token_ordering = order.reshape(c.num_centroids, c.vocab_size // c.num_centroids)
    return Assistant(
        pre_projection=random_matrix(k_pre, (2 * c.backbone_hidden_size, c.hidden_size), dtype, scale),
        model=gemma4.init_params(c.text, k_model, dtype, scale=scale),
        post_projection=random_matrix(k_post, (c.hidden_size, c.backbone_hidden_size), dtype, scale),
        centroids=centroids,
        token_ordering=token_ordering,
        config=c,
    )

