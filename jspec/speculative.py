"""Speculative generation: one jitted round (propose, verify, accept, commit) driven by an
on-device ``lax.while_loop``.

Token bookkeeping per sequence: ``history[b]`` holds the prompt and every emitted token;
the target cache holds ``lengths[b]`` of them, and the one at index ``lengths[b]`` is the
*root* (the last emitted token, the first row of the next verify). A round verifies
``[root, d_1..d_k]``, emits ``d_1..d_a`` and the correction/bonus token, and commits
``root, d_1..d_a`` to the cache. A tree round (``topk > 1``, ``jspec.tree``) verifies the root and
the tree's nodes in one forward with tree attention, moves the accepted path's K/V rows into
chain order behind the root, and goes on as a chain round would.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import tree_verify, verify
from jspec.compile_options import LOOP_COMPILER_OPTIONS
from jspec.drafters.base import CommitContext, Drafter, PrefillContext, RoundContext
from jspec.engine import cache_length, host_batch, is_eos, output_width, prefill
from jspec.execution import with_kernels
from jspec.kv import KVCache
from jspec.models import AnyModel as Model, forward
from jspec.sampling import SamplingParams, probabilities, sample
from jspec.tree import TreeShape, tree_shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Everything a speculation round reads and writes."""

    target_kv: KVCache
    draft_state: Any
    history: jax.Array  # [batch, capacity] prompt + emitted tokens
    prompt_lengths: jax.Array  # [batch]
    num_generated: jax.Array  # [batch] emitted tokens (the first one comes from the prefill)
    features: tuple[jax.Array, ...]  # target features of the last cached row, [batch, hidden] each
    done: jax.Array  # [batch] bool
    key: jax.Array
    rounds: jax.Array  # [batch] verify rounds in which the sequence was live
    accepted: jax.Array  # [batch] draft tokens accepted over those rounds

    @property
    def root(self) -> jax.Array:
        return jnp.take_along_axis(self.history, self.target_kv.lengths[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class SpecResult:
    """``tokens``: new tokens per prompt (as ``jspec.generate``). ``stats``: per-sequence numpy arrays.

    stats keys: ``rounds`` (verify rounds run), ``drafted`` (draft tokens proposed = rounds * k),
    ``accepted`` (drafts accepted), ``mean_acceptance_length`` (tokens emitted per verify round,
    counting accepted drafts plus the one correction/bonus token: ``(accepted + rounds) / rounds``).
    """

    tokens: list[list[int]]
    stats: dict[str, np.ndarray]


def _last_row_features(features, rows):
    """Per-sequence row ``rows [batch]`` of each ``[batch, T, hidden]`` feature."""
    return tuple(jnp.take_along_axis(f, rows[:, None, None], axis=1)[:, 0] for f in features)


def start(target, drafter: Drafter, tokens, prompt_lengths, key, *, params, eos_ids, capacity, max_len):
    """Target and draft prefill, first token sampled: the initial ``SpecState``."""
    batch, width = tokens.shape
    kv = target.init_cache(batch, max_len)
    logits, features, kv = prefill(target, tokens, prompt_lengths, kv, capture=drafter.capture)
    key, sub = jax.random.split(key)
    first = sample(sub, logits, params)
    draft_state = drafter.prefill(PrefillContext(tokens, prompt_lengths, features, first), max_len=max_len)
    history = jnp.zeros((batch, capacity), jnp.int32).at[:, :width].set(tokens)
    history = history.at[jnp.arange(batch), prompt_lengths].set(first)
    zeros = jnp.zeros((batch,), jnp.int32)
    return SpecState(
        target_kv=kv,
        draft_state=draft_state,
        history=history,
        prompt_lengths=prompt_lengths,
        num_generated=zeros + 1,
        features=_last_row_features(features, prompt_lengths - 1),
        done=is_eos(first, eos_ids),
        key=key,
        rounds=zeros,
        accepted=zeros,
    )


def speculative_round(
    target: Model, drafter: Drafter, state: SpecState, *, num_draft_tokens, params, eos_ids, max_new_tokens,
    tree: TreeShape | None = None, acceptance=None,
) -> SpecState:
    """One round: propose drafts (a chain of ``num_draft_tokens``, or a ``tree``), verify them in one
    target forward, accept, commit.

    ``drafter`` must be bound to ``target`` (``drafter.bind(target)``, which
    ``speculative_generate`` does). ``acceptance``: a callable (a pytree, e.g. the benchmarks'
    ``ControlledAcceptance``) that replaces the verification rule of a chain round,
    ``(key, logits [batch, k+1, vocab], draft_tokens [batch, k], round_index [batch]) ->
    (num_accepted, next_token)``; the output is then whatever it accepts, not the target's.
    """
    if acceptance is not None and tree is not None:
        raise ValueError("an acceptance rule replaces chain verification; tree rounds verify by the tree's rules")
    key, draft_key, accept_key = jax.random.split(state.key, 3)
    base = state.target_kv.lengths
    ctx = RoundContext(state.history, base, state.root, state.features, state.target_kv)
    if tree is None:
        draft_tokens, draft_probs, draft_state = drafter.propose(
            state.draft_state, ctx, num_draft_tokens=num_draft_tokens, params=params, key=draft_key
        )
        verify_tokens = jnp.concatenate([state.root[:, None], draft_tokens], axis=1)  # [batch, k+1]
        logits, features, target_kv = forward(target, verify_tokens, state.target_kv, capture=drafter.capture)
        if acceptance is not None:
            num_accepted, next_token = acceptance(accept_key, logits, draft_tokens, state.rounds)
        elif params.greedy:
            num_accepted, next_token = verify.greedy(logits, draft_tokens)
        else:
            num_accepted, next_token = verify.rejection_sample(
                accept_key, probabilities(logits, params), draft_tokens, draft_probs
            )
        path = None
    else:
        draft_tree, draft_state = drafter.propose_tree(state.draft_state, ctx, shape=tree, params=params,
                                                       key=draft_key)
        logits, features, target_kv = forward(target, draft_tree.tokens, state.target_kv, capture=drafter.capture,
                                              tree_mask=draft_tree.mask)
        if params.greedy:
            path, num_accepted, next_token = tree_verify.greedy(
                logits, draft_tree.tokens, draft_tree.parents, depth=tree.max_path)
        else:
            path, num_accepted, next_token = tree_verify.rejection_sample(
                accept_key, probabilities(logits, params), draft_tree.tokens, draft_tree.parents, depth=tree.max_path)
        # The accepted path, stored in node order, becomes the chain a chain round would have left.
        target_kv = target_kv.move_rows(base, path)
        verify_tokens = jnp.take_along_axis(draft_tree.tokens, path, axis=1)  # [batch, depth+1]
        features = tuple(jnp.take_along_axis(f, path[:, :, None], axis=1) for f in features)
    verified = CommitContext(base, verify_tokens, num_accepted, next_token, features, path)
    return _accept(state, drafter, verified, target_kv, draft_state, key, eos_ids=eos_ids,
                   max_new_tokens=max_new_tokens)


def _accept(state, drafter, verified: CommitContext, target_kv, draft_state, key, *, eos_ids,
            max_new_tokens) -> SpecState:
    """Emit the accepted drafts and the next token, commit them to both caches: the part of a round
    after verification. ``verified`` is what the drafter's ``commit`` gets too: ``verify_tokens
    [batch, m+1]`` the root and the drafts along the verified chain (a tree's path), ``features`` the
    target's captures of those rows, ``path [batch, m+1]`` the path's tree node ids (None for a chain)."""
    num_accepted, next_token = verified.num_accepted, verified.next_token
    k = verified.verify_tokens.shape[1] - 1
    base = verified.base_lengths
    draft_tokens = verified.verify_tokens[:, 1:]
    # Emit d_1..d_a then next_token, cut at the first EOS and at max_new_tokens.
    live = ~state.done
    emitted = jnp.concatenate([draft_tokens, next_token[:, None]], axis=1)  # [batch, k+1]
    slot = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    emitted = jnp.where(slot == num_accepted[:, None], next_token[:, None], emitted)
    eos_hit = is_eos(emitted, eos_ids) & (slot <= num_accepted[:, None])
    first_eos = jnp.min(jnp.where(eos_hit, slot, k + 1), axis=1)
    num_emitted = jnp.minimum(num_accepted + 1, first_eos + 1)
    num_emitted = jnp.minimum(num_emitted, max_new_tokens - state.num_generated)
    num_emitted = jnp.where(live, num_emitted, 0)

    # Write the emitted tokens after the root; the slots past num_emitted are junk that a
    # later round overwrites (or that the caller ignores).
    def put(row, new, at):
        return jax.lax.dynamic_update_slice_in_dim(row, new, at, axis=0)

    history = jnp.where(live[:, None], jax.vmap(put)(state.history, emitted, base + 1), state.history)

    committed = jnp.where(live, num_accepted + 1, 0)  # root + accepted drafts enter the cache
    target_kv = target_kv.truncate(base + committed)
    draft_state = drafter.commit(draft_state, verified)
    num_generated = state.num_generated + num_emitted
    done = state.done | (live & (first_eos <= num_accepted)) | (num_generated >= max_new_tokens)
    return SpecState(
        target_kv=target_kv,
        draft_state=draft_state,
        history=history,
        prompt_lengths=state.prompt_lengths,
        num_generated=num_generated,
        features=_last_row_features(verified.features, num_accepted),
        done=done,
        key=key,
        rounds=state.rounds + live,
        accepted=state.accepted + jnp.where(live, num_accepted, 0),
    )


@dataclasses.dataclass(frozen=True)
class Loop:
    """The static settings of one speculative loop (one compiled program per value)."""

    params: SamplingParams
    eos_ids: tuple[int, ...]
    num_draft_tokens: int  # k: a chain's drafts, or a tree's nodes
    capacity: int  # history width: prompt + emitted tokens + a round's rows
    max_len: int  # cache rows
    tree: TreeShape | None = None


@functools.partial(jax.jit, static_argnames=("loop",), compiler_options=LOOP_COMPILER_OPTIONS)
def speculative_on_device(target, drafter, tokens, prompt_lengths, key, max_new_tokens, *, loop: Loop,
                          acceptance=None):
    """Prefill right-padded prompts ``tokens [batch, width]`` of ``prompt_lengths [batch]``, then
    speculation rounds in a ``lax.while_loop`` until every sequence is done.

    ``max_new_tokens`` is traced, and so are the leaves of ``acceptance`` (see
    :func:`speculative_round`). Compiled with :data:`jspec.compile_options.LOOP_COMPILER_OPTIONS`.
    Returns (history ``[batch, capacity]``, emitted counts, rounds, accepted drafts), each per sequence.
    """
    state = start(target, drafter, tokens, prompt_lengths, key, params=loop.params, eos_ids=loop.eos_ids,
                  capacity=loop.capacity, max_len=loop.max_len)
    state = dataclasses.replace(state, done=state.done | (max_new_tokens <= 1))

    def round_(s):
        return speculative_round(
            target, drafter, s, num_draft_tokens=loop.num_draft_tokens, params=loop.params,
            eos_ids=loop.eos_ids, max_new_tokens=max_new_tokens, tree=loop.tree, acceptance=acceptance,
        )

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), round_, state)
    return state.history, state.num_generated, state.rounds, state.accepted


def speculative_generate(
    target: Model,
    drafter,
    prompts,
    max_new_tokens: int,
    *,
    num_draft_tokens: int = 4,
    topk: int = 1,
    depth: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id=None,
    key: jax.Array | None = None,
    impl: str | None = None,
) -> SpecResult:
    """Speculative decoding for a ragged batch; same outputs as ``jspec.generate``.

    Greedy (``temperature=0``) output equals plain greedy decoding token for token; sampled
    output has exactly the target's distribution (temperature / top-k / top-p applied).
    ``drafter``: ``jspec.drafters.DraftModel(model)``, ``jspec.drafters.NGram(...)``, ...
    ``num_draft_tokens`` (k) drafts are verified per round: a chain of k with ``topk=1`` (the
    default), else a tree (EAGLE-2: ``depth`` levels, the ``topk`` best children of the ``topk``
    best nodes of each level, the k best nodes by cumulative draft log-probability kept; the
    drafter must implement ``propose_tree``). ``impl``: the kernels of the target and, through
    ``bind``, of the drafter (as for ``jspec.generate``); None keeps ``target.execution``'s.
    Raises ``ValueError`` on bad input, before any compute.
    """
    target = with_kernels(target, impl)
    c = target.config
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter must implement jspec.drafters.Drafter, got {type(drafter).__name__}")
    tree = tree_shape(topk, depth, num_draft_tokens)
    if tree is not None and not hasattr(drafter, "propose_tree"):
        raise ValueError(f"topk={topk}: {type(drafter).__name__} drafts chains only (topk=1)")
    drafter = drafter.bind(target)  # checks compatibility first
    most = getattr(drafter, "max_draft_tokens", None)  # a block drafter's block bounds a path (DFlash)
    if most is not None and tree is None and num_draft_tokens > most:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} exceeds the {most} drafts a round of "
                         f"{type(drafter).__name__} makes")
    if most is not None and tree is not None and tree.depth > most:
        raise ValueError(f"depth={tree.depth} exceeds the {most} drafts a round of {type(drafter).__name__} makes "
                         "along a path")
    batch = host_batch(target, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_id=eos_id, key=key)
    prompts, tokens, lengths = batch.prompts, batch.tokens, batch.lengths
    longest = max(len(p) for p in prompts) + max_new_tokens
    # A verify writes k+1 rows after the last committed token, so positions run up to k past the end.
    limits = [c.max_position_embeddings] + [m for m in [drafter.max_positions()] if m is not None]
    if longest + num_draft_tokens > min(limits):
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} is too large: the longest prompt plus max_new_tokens "
            f"({longest}) plus k must fit in max_position_embeddings={min(limits)}"
        )
    if max_new_tokens == 0:
        empty = np.zeros(len(prompts), np.int64)
        stats = dict(rounds=empty, drafted=empty, accepted=empty, mean_acceptance_length=empty.astype(float))
        return SpecResult([[] for _ in prompts], stats)
    # Rows written past the committed ones in a round: the verify's, and a tree drafter's fed rows.
    written = num_draft_tokens if tree is None else max(num_draft_tokens, tree.fed_rows)
    room = int(lengths.max()) + output_width(max_new_tokens) + written + 1
    capacity = cache_length(tokens.shape[1], room)
    loop = Loop(batch.params, batch.eos_ids, num_draft_tokens, capacity, capacity, tree)
    history, num_generated, rounds, accepted = speculative_on_device(
        target, drafter, jnp.asarray(tokens), jnp.asarray(lengths), batch.key, jnp.int32(max_new_tokens), loop=loop)
    history, num_generated = np.asarray(history), np.asarray(num_generated)
    rounds, accepted = np.asarray(rounds), np.asarray(accepted)
    out = [history[b, lengths[b] : lengths[b] + num_generated[b]].tolist() for b in range(len(prompts))]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_len = np.where(rounds > 0, (accepted + rounds) / np.maximum(rounds, 1), 0.0)
    stats = dict(rounds=rounds, drafted=rounds * num_draft_tokens, accepted=accepted, mean_acceptance_length=mean_len)
    return SpecResult(out, stats)
