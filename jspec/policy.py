"""Choosing the number of draft tokens k (k = 0: plain decoding) from measured costs.

With per-token acceptance rate ``alpha`` (i.i.d. model), a round of ``k`` drafts emits
``E[len] = (1 - alpha**(k+1)) / (1 - alpha)`` tokens on average and costs
``round_cost[k]`` plain decode steps (``round time / decode step time``, measured at the
batch size in question by ``scripts/bench.py spec``). The best k maximises
``E[len] / round_cost[k]``; plain decoding scores 1. Large batches make rounds relatively
dearer (the target stops being bandwidth-bound), so the choice falls to small k, then 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path


def expected_acceptance_length(alpha: float, k: int) -> float:
    """Tokens emitted per round (accepted drafts + 1) for per-token acceptance ``alpha``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def choose_num_draft_tokens(round_cost: Mapping[int, float], alpha: float) -> int:
    """The k (0 = no speculation) with the highest expected speed-up over plain decoding."""
    if any(cost <= 0 for cost in round_cost.values()):
        raise ValueError("round costs must be positive multiples of a plain decode step")
    best_k, best_speedup = 0, 1.0
    for k, cost in sorted(round_cost.items()):
        speedup = expected_acceptance_length(alpha, k) / cost
        if k >= 1 and speedup > best_speedup:
            best_k, best_speedup = k, speedup
    return best_k


def round_costs_from_benchmark(path, batch: int) -> dict[int, float]:
    """``{k: round / decode step}`` at ``batch`` from a ``scripts/bench.py spec`` JSON."""
    rows = json.loads(Path(path).read_text())["results"]["rounds"]
    costs = {r["k"]: r["overhead_ratio"] for r in rows if r["batch"] == batch}
    if not costs:
        raise ValueError(f"{path} has no round timings at batch {batch}")
    return costs
