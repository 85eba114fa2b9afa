"""Choosing k from measured round costs and an acceptance rate."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from jspec.policy import (
    choose_for_batch,
    choose_num_draft_tokens,
    expected_acceptance_length,
    round_costs_at_batch,
    round_costs_from_benchmark,
    straggler_factor,
)

ROOT = Path(__file__).resolve().parent.parent


def test_expected_acceptance_length():
    assert expected_acceptance_length(0.0, 4) == 1.0
    assert expected_acceptance_length(1.0, 4) == 5.0
    assert expected_acceptance_length(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        expected_acceptance_length(1.5, 2)


def test_cheap_rounds_and_high_acceptance_pick_long_drafts():
    cheap = {k: 1.0 + 0.05 * k for k in range(1, 9)}
    assert choose_num_draft_tokens(cheap, 0.95) == 8
    assert 1 <= choose_num_draft_tokens(cheap, 0.5) < 8


def test_expensive_rounds_or_no_acceptance_pick_plain_decoding():
    dear = {k: 1.5 + 0.5 * k for k in range(1, 9)}  # e.g. a large batch, compute-bound target
    assert choose_num_draft_tokens(dear, 0.6) == 0
    assert choose_num_draft_tokens({k: 1.1 for k in range(1, 5)}, 0.0) == 0


def test_costs_from_the_recorded_benchmark():
    costs = round_costs_from_benchmark(ROOT / "benchmarks" / "spec_rounds_h200.json", batch=1)
    assert sorted(costs) == list(range(1, 9))
    # A 1B draft model for an 8B target, batch 1: worth it only at high acceptance.
    assert choose_num_draft_tokens(costs, 0.3) == 0
    assert choose_num_draft_tokens(costs, 0.9) >= 3


def test_costs_between_measured_batches_interpolate_in_log_batch():
    by_batch = {1: {1: 1.2, 4: 2.0}, 16: {1: 2.0, 4: 6.0, 8: 9.0}}
    assert round_costs_at_batch(by_batch, 1) == {1: 1.2, 4: 2.0}
    assert round_costs_at_batch(by_batch, 4) == pytest.approx({1: 1.6, 4: 4.0})  # halfway in log2
    assert round_costs_at_batch(by_batch, 64) == by_batch[16]  # held beyond the last measurement
    with pytest.raises(ValueError):
        round_costs_at_batch(by_batch, 0)


def test_speculation_switches_off_as_the_batch_grows():
    by_batch = {1: {k: 1.0 + 0.25 * k for k in range(1, 9)}, 64: {k: 1.0 + 1.0 * k for k in range(1, 9)}}
    assert choose_for_batch(by_batch, 1, 0.8) >= 3
    assert choose_for_batch(by_batch, 64, 0.8) == 0
    picks = [choose_for_batch(by_batch, b, 0.8) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert picks == sorted(picks, reverse=True)


def test_round_costs_hold_every_recorded_round_in_either_schema(tmp_path):
    path = ROOT / "benchmarks" / "spec_batch_h200_b16-64.json"  # recorded before the bench CLI's schema
    rows = json.loads(path.read_text())["results"]["rounds"]
    by_batch = round_costs_from_benchmark(path)
    assert sorted(by_batch) == [16, 64]
    assert {(b, k): cost for b, costs in by_batch.items() for k, cost in costs.items()} == {
        (r["batch"], r["k"]): r["overhead_ratio"] for r in rows
    }
    assert round_costs_from_benchmark(path, batch=16) == by_batch[16]
    # The same rounds written by ``python -m jspec.bench spec`` (rows tagged by measure).
    rows_now = [dict(r, measure="round") for r in rows] + [{"measure": "end_to_end", "batch": 16, "k": 4}]
    new = tmp_path / "spec.json"
    new.write_text(json.dumps({"schema": "jspec.bench/1", "command": "spec", "environment": {}, "rows": rows_now}))
    assert round_costs_from_benchmark(new) == by_batch
    with pytest.raises(ValueError, match="no round timings at batch 8"):
        round_costs_from_benchmark(new, batch=8)


def test_straggler_factor():
    assert straggler_factor(0.8, 4, 1, 64) == 1.0  # one sequence: no straggler
    assert straggler_factor(1.0, 4, 64, 64) == pytest.approx(1.0)  # every round emits k + 1
    factors = [straggler_factor(0.8, 4, b, 64) for b in (2, 8, 64)]
    assert 1.0 < factors[0] < factors[1] < factors[2] < 1.5
    assert straggler_factor(0.8, 4, 64, 1024) < factors[2]  # long generations average out
    with pytest.raises(ValueError):
        straggler_factor(0.8, 4, 0, 64)


def test_static_batches_lose_where_round_costs_alone_would_speculate():
    # The recorded batch-64 case: k = 4 at alpha 0.8 looks like 1.37x per round, measured 0.92x.
    costs = round_costs_from_benchmark(ROOT / "benchmarks" / "spec_batch_h200_b16-64.json", batch=64)
    speedup = expected_acceptance_length(0.8, 4) / costs[4]
    assert speedup > 1.3
    assert speedup / straggler_factor(0.8, 4, 64, 64) < speedup / 1.25
    assert choose_num_draft_tokens(costs, 0.8, batch=64, new_tokens=64) < 4
