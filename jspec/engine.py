"""Prefill, plain decoding and scoring: jitted pure functions plus their host-side front doors.

The front doors (``generate``, ``score``) validate every input on the host and raise
``ValueError`` before anything is compiled or run; the jitted parts assume valid input.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.compile_options import LOOP_COMPILER_OPTIONS
from jspec.execution import with_kernels
from jspec.kv import KVCache
from jspec.models import AnyModel as Model, forward
from jspec.models.base import NO_CAPTURE, Capture
from jspec.sampling import SamplingParams, sample

# Prompt and cache lengths are rounded up so that a handful of compiled shapes serve all inputs.
_MIN_BUCKET = 16
_CACHE_ALIGN = 128


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket(n: int) -> int:
    """The next power of two >= ``n`` (at least 16): padded prompt and output widths."""
    return max(_MIN_BUCKET, 1 << (n - 1).bit_length())


def cache_length(prompt_width: int, max_total: int) -> int:
    """Cache rows needed to hold the padded prompt and every token up to ``max_total``."""
    return _round_up(max(prompt_width, max_total), _CACHE_ALIGN)


def validate_prompts(prompts, vocab_size: int, max_new_tokens, max_positions: int) -> list[list[int]]:
    """Check a ragged batch of prompts; returns them as lists of Python ints."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    checked = []
    for b, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1:
            raise ValueError(f"prompt {b} must be a flat list of token ids, got shape {ids.shape}")
        if ids.size == 0:
            raise ValueError(f"prompt {b} is empty")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt {b} must hold integer token ids, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            raise ValueError(
                f"prompt {b} has token id {int(ids[bad][0])} outside the vocabulary [0, {vocab_size})"
            )
        if ids.size + max_new_tokens > max_positions:
            raise ValueError(
                f"prompt {b} has {ids.size} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"the model's max_position_embeddings={max_positions}"
            )
        checked.append([int(t) for t in ids])
    return checked


def pad_prompts(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to the bucket width: tokens ``[batch, width]`` int32 and lengths ``[batch]``."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), bucket(int(lengths.max()))), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    return tokens, lengths


def eos_tuple(eos_id) -> tuple[int, ...]:
    if eos_id is None:
        return ()
    ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
    return tuple(int(i) for i in ids)


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    hit = jnp.zeros(tokens.shape, bool)
    for e in eos_ids:
        hit |= tokens == e
    return hit


def prefill(model: Model, tokens: jax.Array, prompt_lengths: jax.Array, kv: KVCache, *, capture: Capture = NO_CAPTURE):
    """Run right-padded prompts ``tokens [batch, width]`` into an empty cache.

    Only the last real row of each prompt gets the LM head. Returns (fp32 logits
    ``[batch, vocab]``, captured features ``[batch, width, hidden]`` each, cache holding
    exactly ``prompt_lengths`` rows per sequence).
    """
    last_rows = (prompt_lengths - 1)[:, None]
    logits, features, kv = forward(model, tokens, kv, capture=capture, logits_rows=last_rows)
    return logits[:, 0], features, kv.truncate(prompt_lengths)


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """A ragged batch of prompts checked on the host, as the on-device loops take it."""

    prompts: list[list[int]]
    tokens: np.ndarray  # [batch, width] int32, right-padded to a bucket width
    lengths: np.ndarray  # [batch] int32
    params: SamplingParams
    eos_ids: tuple[int, ...]
    key: jax.Array


def host_batch(model, prompts, max_new_tokens, *, temperature, top_k, top_p, eos_id, key) -> HostBatch:
    """The front doors' shared prologue: sampling parameters, prompts and EOS ids checked (``ValueError``
    naming what is wrong, before any compute), the prompts padded, the key defaulted."""
    c = model.config
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    prompts = validate_prompts(prompts, c.vocab_size, max_new_tokens, c.max_position_embeddings)
    tokens, lengths = pad_prompts(prompts)
    return HostBatch(prompts, tokens, lengths, params, eos_tuple(eos_id), jax.random.key(0) if key is None else key)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything one plain decode step reads and writes."""

    kv: KVCache
    last_token: jax.Array  # [batch] int32, not yet in the cache
    output: jax.Array  # [batch, output_width] int32 generated tokens
    num_generated: jax.Array  # [batch] int32
    done: jax.Array  # [batch] bool
    step: jax.Array  # [] int32, number of tokens emitted so far (all sequences)
    key: jax.Array


def decode_step(model: Model, state: DecodeState, *, params: SamplingParams, eos_ids: tuple[int, ...]):
    """One decode step: feed ``state.last_token [batch]`` through ``forward`` (one row per sequence),
    sample the next token from its fp32 logits ``[batch, vocab]`` with ``params``, write it at
    ``state.output[:, state.step]``. Finished sequences (an id of ``eos_ids`` drawn) keep their output.
    Returns the next :class:`DecodeState`."""
    batch = state.last_token.shape[0]
    logits, _, kv = forward(model, state.last_token[:, None], state.kv, logits_rows=jnp.zeros((batch, 1), jnp.int32))
    logits = logits[:, 0]
    key, sub = jax.random.split(state.key)
    token = sample(sub, logits, params)
    live = ~state.done
    output = state.output.at[:, state.step].set(jnp.where(live, token, 0))
    return DecodeState(
        kv=kv,
        last_token=token,
        output=output,
        num_generated=state.num_generated + live,
        done=state.done | is_eos(token, eos_ids),
        step=state.step + 1,
        key=key,
    )


@functools.partial(jax.jit, static_argnames=("params", "eos_ids"), donate_argnames=("state",))
def decode_step_jit(model, state, *, params, eos_ids=()):
    """One donated decode step (for streaming and benchmarks); ``generate`` loops on device."""
    return decode_step(model, state, params=params, eos_ids=eos_ids)


def start_decoding(model, tokens, prompt_lengths, key, *, params, eos_ids, output_width, max_len):
    """Prefill and sample the first new token; returns the initial ``DecodeState``."""
    batch = tokens.shape[0]
    kv = model.init_cache(batch, max_len)
    logits, _, kv = prefill(model, tokens, prompt_lengths, kv)
    key, sub = jax.random.split(key)
    first = sample(sub, logits, params)
    return DecodeState(
        kv=kv,
        last_token=first,
        output=jnp.zeros((batch, output_width), jnp.int32).at[:, 0].set(first),
        num_generated=jnp.ones((batch,), jnp.int32),
        done=is_eos(first, eos_ids),
        step=jnp.array(1, jnp.int32),
        key=key,
    )


def output_width(max_new_tokens: int) -> int:
    """Output buffer width: a power of two, so nearby ``max_new_tokens`` share one program."""
    return bucket(max_new_tokens)


@functools.partial(jax.jit, static_argnames=("params", "eos_ids", "output_width", "max_len"),
                   compiler_options=LOOP_COMPILER_OPTIONS)
def generate_on_device(model, tokens, prompt_lengths, key, max_new_tokens, *, params, eos_ids, output_width, max_len):
    """Prefill, then decode in a ``lax.while_loop`` until every sequence is done.

    ``max_new_tokens`` is a traced scalar (<= ``output_width``). Returns the output buffer
    ``[batch, output_width]`` and the number of valid tokens per sequence ``[batch]``. Compiled
    with :data:`jspec.compile_options.LOOP_COMPILER_OPTIONS`.
    """
    state = start_decoding(model, tokens, prompt_lengths, key, params=params, eos_ids=eos_ids,
                           output_width=output_width, max_len=max_len)

    def keep_going(s):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def step(s):
        return decode_step(model, s, params=params, eos_ids=eos_ids)

    state = jax.lax.while_loop(keep_going, step, state)
    return state.output, state.num_generated


def generate(
    model: Model,
    prompts,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id=None,
    key: jax.Array | None = None,
    impl: str | None = None,
) -> list[list[int]]:
    """Plain autoregressive generation for a ragged batch of prompts.

    Args:
      prompts: list of token-id lists (different lengths allowed).
      max_new_tokens: new tokens per prompt (a sequence stops early after ``eos_id``,
        which is included in its output; ``eos_id`` may be an int or a list of ints).
      temperature, top_k, top_p: as in HF ``generate``; ``temperature=0`` is greedy.
      key: PRNG key for sampling (defaults to ``jax.random.key(0)``).
      impl: the kernels to run (``"auto"``, ``"xla"``, ``"pallas"``, ``"invariant"``, optionally with
        per-kernel exceptions such as ``"auto,skinny_matmul=xla"``); None keeps ``model.execution``'s.

    Returns the new tokens of each prompt. Raises ``ValueError`` on bad input before any compute.
    """
    model = with_kernels(model, impl)
    batch = host_batch(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_id=eos_id, key=key)
    if max_new_tokens == 0:
        return [[] for _ in batch.prompts]
    tokens, lengths = batch.tokens, batch.lengths
    max_len = cache_length(tokens.shape[1], int(lengths.max()) + output_width(max_new_tokens))
    output, counts = generate_on_device(
        model, jnp.asarray(tokens), jnp.asarray(lengths), batch.key, jnp.int32(max_new_tokens),
        params=batch.params, eos_ids=batch.eos_ids, output_width=output_width(max_new_tokens), max_len=max_len,
    )
    output, counts = np.asarray(output), np.asarray(counts)
    return [output[b, : counts[b]].tolist() for b in range(len(batch.prompts))]


@jax.jit
def _score_on_device(model, tokens):
    kv = model.init_cache(tokens.shape[0], tokens.shape[1])
    logits, _, _ = forward(model, tokens, kv)
    return logits


def score(model: Model, token_ids, *, impl: str | None = None) -> jax.Array:
    """Full-sequence fp32 logits ``[batch, T, vocab]`` for equal-length rows ``token_ids [batch, T]``;
    ``impl`` as for :func:`generate`."""
    model = with_kernels(model, impl)
    c = model.config
    ids = np.asarray(token_ids)
    if ids.ndim != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise ValueError(f"token_ids must be a non-empty [batch, T] array of equal-length rows, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must hold integer token ids, got dtype {ids.dtype}")
    if ((ids < 0) | (ids >= c.vocab_size)).any():
        raise ValueError(f"token_ids has ids outside the vocabulary [0, {c.vocab_size})")
    if ids.shape[1] > c.max_position_embeddings:
        raise ValueError(f"T={ids.shape[1]} exceeds max_position_embeddings={c.max_position_embeddings}")
    return _score_on_device(model, jnp.asarray(ids, jnp.int32))
