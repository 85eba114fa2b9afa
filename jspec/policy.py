"""Choosing the number of draft tokens k (k = 0: plain decoding) from measured costs.

With per-token acceptance rate ``alpha`` (i.i.d. model), a round of ``k`` drafts emits
``E[len] = (1 - alpha**(k+1)) / (1 - alpha)`` tokens on average and costs
``round_cost[k]`` plain decode steps (``round time / decode step time``, measured at the
batch size in question by ``python -m jspec.bench spec``). The best k maximises
``E[len] / round_cost[k]``; plain decoding scores 1. Large batches make rounds relatively
dearer (the target stops being bandwidth-bound), so the choice falls to small k, then 0.

A static batch runs until its slowest sequence has its tokens: with ``new_tokens`` given, the
speed-up is divided by :func:`straggler_factor`, the expected rounds of the slowest of ``batch``
sequences over the mean (without it, a large batch's predicted speed-up can turn into a slowdown
end to end; figures: ``benchmarks/README.md``, batch sweep and the k policy). Continuous batching,
which refills finished slots, pays no such penalty: leave ``new_tokens`` out there.

Costs are measured at a few batch sizes; :func:`choose_for_batch` serves any batch size by
interpolating each k's cost linearly in ``log2(batch)`` between the measured neighbours (and
holding the nearest measurement outside their range).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from pathlib import Path


def expected_acceptance_length(alpha: float, k: int) -> float:
    """Tokens emitted per round (accepted drafts + 1) for per-token acceptance ``alpha``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def straggler_factor(alpha: float, k: int, batch: int, new_tokens: int) -> float:
    """E[rounds of the slowest of ``batch`` sequences] / E[rounds of one], each emitting
    ``new_tokens``: a normal approximation of the renewal count (rounds ~ N(n/mu, n*var/mu**3) for
    per-round emitted tokens of mean mu and variance var) and the Gaussian maximum bound
    ``mean + std * sqrt(2 ln batch)``. 1 for one sequence or deterministic rounds."""
    if batch < 1 or new_tokens < 1:
        raise ValueError(f"batch and new_tokens must be >= 1, got {batch}, {new_tokens}")
    mean = expected_acceptance_length(alpha, k)
    # Emitted tokens per round: j (1 <= j <= k) with prob alpha**(j-1) * (1 - alpha), k+1 with alpha**k.
    second = sum(j * j * alpha ** (j - 1) * (1 - alpha) for j in range(1, k + 1)) + (k + 1) ** 2 * alpha**k
    variance = max(second - mean * mean, 0.0)
    rounds = new_tokens / mean
    rounds_std = math.sqrt(new_tokens * variance / mean**3)
    return (rounds + rounds_std * math.sqrt(2 * math.log(batch))) / rounds


def choose_num_draft_tokens(
    round_cost: Mapping[int, float], alpha: float, *, batch: int = 1, new_tokens: int | None = None
) -> int:
    """The k (0 = no speculation) with the highest expected speed-up over plain decoding
    (straggler-corrected for a static batch of ``batch`` sequences when ``new_tokens`` is given)."""
    if any(cost <= 0 for cost in round_cost.values()):
        raise ValueError("round costs must be positive multiples of a plain decode step")
    best_k, best_speedup = 0, 1.0
    for k, cost in sorted(round_cost.items()):
        speedup = expected_acceptance_length(alpha, k) / cost
        if new_tokens is not None:
            speedup /= straggler_factor(alpha, k, batch, new_tokens)
        if k >= 1 and speedup > best_speedup:
            best_k, best_speedup = k, speedup
    return best_k


def round_costs_at_batch(costs_by_batch: Mapping[int, Mapping[int, float]], batch: int) -> dict[int, float]:
    """``{k: cost}`` at any ``batch`` from ``{measured batch: {k: cost}}`` (see module docstring).

    Only the k measured at both neighbouring batch sizes are kept."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    measured = sorted(costs_by_batch)
    if not measured:
        raise ValueError("no round costs given")
    i = bisect.bisect_left(measured, batch)
    if i < len(measured) and measured[i] == batch:
        return dict(costs_by_batch[batch])
    if i == 0 or i == len(measured):
        return dict(costs_by_batch[measured[min(i, len(measured) - 1)]])
    lo, hi = measured[i - 1], measured[i]
    t = (math.log2(batch) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    shared = costs_by_batch[lo].keys() & costs_by_batch[hi].keys()
    return {k: (1 - t) * costs_by_batch[lo][k] + t * costs_by_batch[hi][k] for k in sorted(shared)}


def choose_for_batch(
    costs_by_batch: Mapping[int, Mapping[int, float]], batch: int, alpha: float, *, new_tokens: int | None = None
) -> int:
    """The k (0 = plain decoding) for ``batch`` sequences at acceptance rate ``alpha`` (static
    batches of ``new_tokens`` each: straggler-corrected, see the module docstring)."""
    costs = round_costs_at_batch(costs_by_batch, batch)
    return choose_num_draft_tokens(costs, alpha, batch=batch, new_tokens=new_tokens)


def round_costs_by_batch(rounds) -> dict[int, dict[int, float]]:
    """``{batch: {k: round / decode step}}`` from round rows of ``python -m jspec.bench spec``
    (dicts with ``batch``, ``k`` and ``overhead_ratio``)."""
    by_batch: dict[int, dict[int, float]] = {}
    for r in rounds:
        by_batch.setdefault(int(r["batch"]), {})[int(r["k"])] = float(r["overhead_ratio"])
    return by_batch


def round_costs_from_benchmark(path, batch: int | None = None):
    """Round costs from a ``python -m jspec.bench spec`` JSON (its ``rows`` with ``measure ==
    "round"``, or ``results.rounds`` in files recorded before that schema): ``{k: round / decode
    step}`` at ``batch``, or ``{batch: {k: ...}}`` for every measured batch when ``batch`` is None."""
    data = json.loads(Path(path).read_text())
    if "rows" in data:
        rounds = [row for row in data["rows"] if row.get("measure") == "round"]
    else:
        rounds = data["results"]["rounds"]
    by_batch = round_costs_by_batch(rounds)
    if batch is None:
        return by_batch
    if batch not in by_batch:
        raise ValueError(f"{path} has no round timings at batch {batch}")
    return by_batch[batch]
