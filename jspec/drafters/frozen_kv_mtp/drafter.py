"""``FrozenKVMTP``: the Gemma 4 assistant (HF transformers ``Gemma4AssistantForCausalLM``) as a drafter.

The assistant keeps no state: no draft KV, no prefill forward, no catch-up. A round's
``propose`` reads the bonus token ``ctx.root`` (at position ``ctx.lengths``), the target's
final-normed hidden of the last committed row ``ctx.features[0]`` and the target's cache
``ctx.target_kv`` (read-only), and runs ``k`` assistant steps in one ``lax.scan``: the seed
step on (bonus token, target hidden) is iteration 0, steps ``1..k-1`` recycle the assistant's
own projected hidden with its previous draft.

Two settings where public implementations differ are options; the defaults are transformers
5.23's, the behavioural reference the parity tests pin (what the published assistants were
trained with is not settled by code: measure acceptance both ways on real weights):

* ``rope_position``: every step of a round uses one RoPE position. ``"bonus"`` (default,
  transformers): the bonus token's position ``p + 1 = ctx.lengths``. ``"last_committed"``
  (SGLang, vLLM, tpu-inference): the last committed slot ``p``.
* ``sliding_rows``: how many of the target's committed rows a sliding assistant layer sees,
  ending at the last committed row (``W``: the assistant's ``sliding_window``). ``"window+1"``
  (default): transformers builds a bidirectional sliding mask (``|q - kv| <= W``) flipped onto
  the target's sliding K/V, which after a prefill or a verify of two or more rows holds at least
  ``W + 1`` rows: the last ``W + 1`` are visible. ``"window"``: the last ``W``, what the target's
  own sliding layer shows its last committed row (SGLang, vLLM).

The token embedding is scaled by ``sqrt(H_b)`` in the table's dtype (transformers,
tpu-inference). The centroid head's logits fill the tokens off its candidates with
``min - 1`` as transformers does where drafting is greedy (the argmax is the same), and with
``-inf`` where drafts are sampled, so that ``q`` is zero there.

Full assistant layers see every committed row. Rows past ``ctx.lengths`` (rejected drafts of the
last verify) are never read: unlike transformers, which keeps a rejected draft's K/V at the
bonus position after a partial rejection, jspec drafts from the accepted tokens only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.drafters.frozen_kv_mtp.assistant import (
    Assistant,
    FrozenKV,
    assistant_logits,
    assistant_step,
    frozen_kv,
    greedy_token,
)
from jspec.drafters.frozen_kv_mtp.checkpoint import load_assistant
from jspec.execution import DEFAULT, Execution
from jspec.parallel import ROW, split
from jspec.kv import KVCache
from jspec.models import gemma4
from jspec.models.base import Capture
from jspec.quant import TABLE_WEIGHT
from jspec.sampling import SamplingParams, probabilities, sample
from jspec.tree import TreeShape, expand

ROPE_POSITIONS = ("bonus", "last_committed")
SLIDING_ROWS = ("window+1", "window")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrozenKVMTP:
    """Gemma 4 assistant drafter (API): ``FrozenKVMTP(assistant, rope_position=..., sliding_rows=...)``
    or ``FrozenKVMTP.load(path)``; ``bind(target)`` (done by ``speculative_generate``) attaches
    the target's input embedding and picks the target layers whose K/V the assistant reads."""

    assistant: Assistant
    embed: jax.Array | None = split(ROW, metadata=TABLE_WEIGHT, default=None)  # the target's input embedding table [V, H_b], set by bind
    # (layer type, target cache layer) per assistant layer type: the last non-shared target layer of that type
    kv_layers: tuple[tuple[str, int], ...] | None = dataclasses.field(default=None, metadata=dict(static=True))
    rope_position: str = dataclasses.field(default="bonus", metadata=dict(static=True))
    sliding_rows: str = dataclasses.field(default="window+1", metadata=dict(static=True))
    # The target's kernels, set by bind (one impl= for target and drafter); never a placement.
    execution: Execution = dataclasses.field(default=DEFAULT, metadata=dict(static=True))

    def __post_init__(self):
        if self.rope_position not in ROPE_POSITIONS:
            raise ValueError(f"FrozenKVMTP rope_position must be one of {ROPE_POSITIONS}, got {self.rope_position!r}")
        if self.sliding_rows not in SLIDING_ROWS:
            raise ValueError(f"FrozenKVMTP sliding_rows must be one of {SLIDING_ROWS}, got {self.sliding_rows!r}")

    @classmethod
    def load(cls, path, *, dtype=None, **options) -> FrozenKVMTP:
        """The drafter from a ``gemma4_assistant`` checkpoint directory (see
        ``jspec.drafters.frozen_kv_mtp.checkpoint``); ``options``: ``rope_position``,
        ``sliding_rows``."""
        return cls(load_assistant(path, dtype=dtype), **options)

    # --- protocol ---------------------------------------------------------------------

    @property
    def capture(self) -> Capture:
        return Capture(final_normed=True)

    def max_positions(self) -> None:
        return None  # positions are the target's; RoPE has no hard limit

    def check_compatible(self, target) -> None:
        if not isinstance(target, gemma4.Model):
            raise ValueError(
                f"FrozenKVMTP (the Gemma 4 assistant) drafts for Gemma 4 targets only, not {target.config.architecture}"
            )
        ac, tc = self.assistant.config, target.config
        if ac.backbone_hidden_size != tc.hidden_size:
            raise ValueError(
                f"Gemma 4 assistant backbone_hidden_size {ac.backbone_hidden_size} != "
                f"target hidden_size {tc.hidden_size}"
            )
        if ac.vocab_size != tc.vocab_size:
            raise ValueError(f"Gemma 4 assistant vocab_size {ac.vocab_size} != target vocab_size {tc.vocab_size}")
        for kind in ac.layer_kinds:
            source = tc.last_kv_owner(kind)
            if source is None:
                raise ValueError(
                    f"the target has no {kind} layer with its own K/V, which the assistant's {kind} layers read"
                )
            kv_heads, head_dim = tc.attention_shape(source)
            if head_dim != ac.head_dim(kind):
                raise ValueError(
                    f"Gemma 4 assistant {kind} head_dim {ac.head_dim(kind)} != the target's {head_dim} "
                    f"(its layer {source}, whose K/V the assistant reads)"
                )
            if ac.text.num_heads % kv_heads:
                raise ValueError(
                    f"Gemma 4 assistant num_attention_heads {ac.text.num_heads} is not a multiple of the target's "
                    f"{kv_heads} {kind} KV heads"
                )

    def bind(self, target) -> FrozenKVMTP:
        self.check_compatible(target)
        kv_layers = tuple((kind, target.config.last_kv_owner(kind)) for kind in self.assistant.config.layer_kinds)
        return dataclasses.replace(self, embed=target.embed, kv_layers=kv_layers,
                                   execution=Execution(target.execution.kernels))

    def prefill(self, ctx: PrefillContext, *, max_len: int) -> tuple:
        return ()  # no draft state: the first round's seed reads the prefill's capture

    def propose(self, dstate, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key):
        kv = self.frozen_kv(ctx.target_kv, ctx.lengths)
        keys = jax.random.split(key, num_draft_tokens)
        tokens, probs = self.draft_scan(kv, ctx.root, ctx.features[0], keys, params)
        return tokens, probs, dstate

    def propose_tree(self, dstate, ctx: RoundContext, *, shape: TreeShape, params: SamplingParams, key):
        """A draft tree (``jspec.tree.expand``): the seed step on the bonus token gives the root's
        children; each level runs the ``topk`` frontier nodes as branches, each continuing from its
        parent's recurrent hidden (its ancestry lives in that state, as in SGLang). Every branch reads
        the same committed target rows; the target cache is never written."""
        del params, key  # tree drafts are the deterministic top-k children, whatever the sampling
        kv = self.frozen_kv(ctx.target_kv, ctx.lengths)
        y, hidden = self.step(kv, ctx.root, ctx.features[0].astype(self.assistant.dtype))

        def step(hiddens, tokens, parent_slot, level):
            del level  # every step of a round uses one RoPE position
            parent_hidden = jnp.take_along_axis(hiddens, parent_slot[:, :, None], axis=1)
            y, hiddens = self.step(kv, tokens, parent_hidden)
            return self.log_probs(y), hiddens

        branches = jnp.repeat(hidden[:, None], shape.topk, axis=1)  # [batch, topk, H_b]
        tree, _, _ = expand(self.log_probs(y), ctx.root, step, branches, topk=shape.topk, depth=shape.depth,
                            num_nodes=shape.num_nodes)
        return tree, dstate

    def commit(self, dstate, ctx: CommitContext) -> tuple:
        return dstate  # nothing to roll back or catch up

    # --- the round's pieces (public for the benchmark lab) ------------------------------

    def frozen_kv(self, target_kv: KVCache, lengths) -> FrozenKV:
        """The assistant's read-only view of ``target_kv`` for a round at ``lengths [batch]``
        committed rows (RoPE position and sliding rows as the options say)."""
        if self.kv_layers is None:
            raise ValueError("FrozenKVMTP: call drafter.bind(target) first (it reads the target's embedding and K/V)")
        rope_positions = lengths if self.rope_position == "bonus" else lengths - 1
        window = self.assistant.config.text.sliding_window
        return frozen_kv(
            self.assistant.config,
            {kind: target_kv.k[layer] for kind, layer in self.kv_layers},
            {kind: target_kv.v[layer] for kind, layer in self.kv_layers},
            lengths,
            rope_positions,
            sliding_rows=window + 1 if self.sliding_rows == "window+1" else window,
            dtype=self.assistant.dtype,
        )

    def step(self, kv: FrozenKV, tokens, hidden):
        """One assistant forward: ``(y [batch, H_a]`` final-normed, ``next hidden [batch, H_b])``."""
        return assistant_step(self.assistant, self.embed, tokens, hidden, kv, self.execution)

    def head_logits(self, y):
        """fp32 draft logits ``[batch, V]`` as transformers computes them (centroid head: ``min - 1``
        off the candidates)."""
        return assistant_logits(self.assistant, y)

    def log_probs(self, y):
        """fp32 log-probabilities ``[..., V]`` of final-normed ``y [..., H_a]``; zero probability off
        the centroid head's candidates."""
        rows = y.reshape(-1, y.shape[-1])
        logits = assistant_logits(self.assistant, rows, masked="-inf")
        return jax.nn.log_softmax(logits, axis=-1).reshape(*y.shape[:-1], -1)

    def draw(self, key, y, params: SamplingParams):
        """The draft token ``[batch]`` of final-normed ``y`` and, when sampling, the exact
        distribution it was drawn from ``[batch, V]`` (zero off the centroid head's candidates)."""
        if params.greedy:
            return greedy_token(self.assistant, y), None
        logits = assistant_logits(self.assistant, y, masked="-inf")
        return sample(key, logits, params), probabilities(logits, params)

    def draft_scan(self, kv: FrozenKV, token, hidden, keys, params: SamplingParams):
        """``len(keys)`` steps from ``token [batch]`` and ``hidden [batch, H_b]`` in one ``lax.scan``:
        ``(tokens [batch, n] int32, probs [batch, n, V] | None)``."""

        def one(carry, step_key):
            token, hidden = carry
            y, hidden = self.step(kv, token, hidden)
            draft, probs = self.draw(step_key, y, params)
            return (draft, hidden), (draft, probs)

        hidden = hidden.astype(self.assistant.dtype)  # the carry keeps one dtype
        # Rolled, unlike the hidden-state heads' one-layer steps: unrolled, the E4B-shaped assistant's
        # propose runs several times slower in the on-device loop (gaps between its launches).
        _, (tokens, probs) = jax.lax.scan(one, (token, hidden), keys)
        return tokens.T, None if probs is None else probs.transpose(1, 0, 2)
