"""The benchmark lab (jspec.bench): the CLI's help, every subcommand's --tiny run checked against
the result schema and one sanity figure, the schema's validation, presets and roofline byte
counts, and the benchmark-only catch-up variants against the library's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.bench import catch_up, cli, report
from jspec.bench.flags import apply_tiny
from jspec.bench.presets import abstract_target, confident
from jspec.bench.roofline import kv_bytes_per_step, weight_bytes_per_step
from jspec.bench.timing import Timing, gpu_kernel_times, interleaved_gpu_times, own_times
from jspec.drafters import Eagle3
from jspec.policy import round_costs_from_benchmark
from tests.tiny import TINY_GEMMA4, eagle3_head, tiny_gemma4, tiny_model

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = ["decode", "spec", "compile", "kernels", "matmul", "catch-up", "frozen-kv", "accept", "invariant",
               "gguf-quality"]
KERNEL_ACTIONS = ["copy-bandwidth", "check", "decode-attention", "gather-rows", "plot", "merge", "all", "draft-attention-gemma4"]


def _bench(*argv) -> int:
    return cli.main([str(a) for a in argv])


def _help(*argv) -> None:
    with pytest.raises(SystemExit) as exit_:
        _bench(*argv, "--help")
    assert exit_.value.code == 0


def test_module_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "jspec.bench", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120).stdout
    assert all(name in out for name in SUBCOMMANDS)


@pytest.mark.parametrize("argv", [[name] for name in SUBCOMMANDS] + [["kernels", a] for a in KERNEL_ACTIONS])
def test_help(argv, capsys):
    _help(*argv)
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m jspec.bench " + " ".join(argv))
    measures = argv != ["kernels"] and argv[-1] not in ("plot", "merge")  # flags of the measuring actions
    assert measures == all(flag in out for flag in ("--tiny", "--out", "--dtype", "--seed", "--repeats"))


def _result(path) -> dict:
    result = report.validate(json.loads(Path(path).read_text()))
    assert result["environment"]["platform"] == "cpu" and result["argv"][0] in SUBCOMMANDS
    return result


def test_decode_tiny(tmp_path):
    out = tmp_path / "decode.json"
    _bench("decode", "--tiny", "--out", out, "--verify-trees", "2:2:3")
    result = _result(out)
    (row,) = report.rows(result, "decode")
    assert result["command"] == "decode" and row["target"] == "tiny"
    assert row["roofline_fraction"] > 0 and row["weight_bytes"] > 0
    (tree,) = row["verify_trees"]  # a tree verify of 3 nodes beside a chain of depth 2
    assert (tree["nodes"], tree["depth"]) == (3, 2) and tree["tree_verify_ms"] > 0 and tree["chain_verify_ms"] > 0
    assert {"1_token", "256_tokens"} <= set(row["timings"]) and result["copy_bandwidth"]["bytes_per_s"] > 0
    assert out.with_suffix(".png").exists()


def test_decode_loop_only_times_the_loop_alone(tmp_path):
    """A Gemma 4 target's loop (--tiny keeps the tiny presets of --targets) against its roofline."""
    out = tmp_path / "decode.json"
    _bench("decode", "--tiny", "--out", out, "--targets", "llama-3.1-8b", "tiny-gemma4", "--loop-only")
    (row,) = report.rows(_result(out), "decode")
    assert row["target"] == "tiny-gemma4" and row["roofline_fraction"] > 0 and row["weight_bytes"] > 0
    assert row["ms_per_token"] > 0 and not {"step_ms", "step_profile", "verify_ms"} & set(row)
    with pytest.raises(SystemExit, match="--loop-only times the loop alone"):
        _bench("decode", "--tiny", "--out", out, "--targets", "tiny", "--loop-only", "--verify-rows", "3")


def test_decode_compares_weight_formats_and_times_several_verify_widths(tmp_path):
    """--weights: one row per format, each against its own roofline (a quantized step reads fewer
    bytes); --verify-rows: a verify forward per width, each beside the step."""
    out = tmp_path / "decode.json"
    _bench("decode", "--tiny", "--out", out, "--targets", "tiny", "--weights", "bf16", "int4-g32",
           "--verify-rows", "2", "3")
    rows = report.rows(_result(out), "decode")
    assert [r["weights"] for r in rows] == ["bf16", "int4-g32"]
    assert rows[0]["weight_bytes"] > rows[1]["weight_bytes"]
    assert all([v["rows"] for v in r["verify"]] == [2, 3] and all(v["verify_ms"] > 0 for v in r["verify"])
               for r in rows)
    with pytest.raises(SystemExit):  # argparse names the unknown scheme
        _bench("decode", "--tiny", "--out", out, "--weights", "int3")


def test_a_quantized_preset_is_the_quantized_bf16_preset():
    """Made a layer at a time (a 70B-shaped int4 model never exists in bf16), the same values."""
    from jspec.bench.presets import init_quantized

    made = init_quantized(jspec.bench.presets.PRESETS["tiny"], jax.random.key(0), jnp.bfloat16, "int4-g32")
    expected = jspec.quantize(jspec.init_params(jspec.bench.presets.PRESETS["tiny"], jax.random.key(0),
                                                jnp.bfloat16), "int4-g32")
    assert jax.tree.structure(made) == jax.tree.structure(expected)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(expected)))


def test_a_compile_cache_keeps_the_programs_and_the_json_says_where(tmp_path):
    """--compile-cache DIR: every compiled program lands in DIR (a rerun loads it); its own process,
    since JAX's cache is process-wide."""
    out, cache = tmp_path / "decode.json", tmp_path / "cache"
    subprocess.run([sys.executable, "-m", "jspec.bench", "decode", "--tiny", "--out", str(out), "--targets", "tiny",
                    "--loop-only", "--compile-cache", str(cache)], check=True, capture_output=True, cwd=ROOT)
    assert _result(out)["environment"]["compilation_cache"] == str(cache)
    assert any(path.name.startswith("jit_generate_on_device") for path in cache.iterdir())


def test_spec_tiny_controlled_acceptance_accepts_everything_at_alpha_1(tmp_path):
    """A Gemma 4 target drafted by a Llama-family draft model: rounds with stages, end to end,
    the policy; at alpha = 1 every draft is accepted (k + 1 tokens per round), and the JSON says
    how acceptance was controlled."""
    out = tmp_path / "spec.json"
    _bench("spec", "--tiny", "--out", out, "--target", "tiny-gemma4", "--alpha", "1.0")
    result = _result(out)
    (round_,) = report.rows(result, "round")
    assert round_["k"] == 2 and round_["overhead_ratio"] > 0 and {"propose", "verify"} <= set(round_["timings"])
    # the propose's bandwidth roofline from this run's copy bandwidth (a draft model reads itself per draft)
    assert round_["propose_bytes"] > 0 and result["copy_bandwidth"]["bytes_per_s"] > 0
    # proposes back to back in one on-device loop, less the loop's own iteration (an empty body)
    assert {"propose_in_loop_16", "empty_in_loop_16"} <= set(round_["timings"])
    assert round_["propose_net_ms"] == pytest.approx(round_["propose_in_loop_ms"] - round_["loop_iteration_ms"])
    assert round_["propose_fraction_of_copy"] == pytest.approx(
        round_["propose_bytes"] / (round_["propose_net_ms"] * 1e-3) / result["copy_bandwidth"]["bytes_per_s"])
    (e2e,) = report.rows(result, "end_to_end")
    assert e2e["mean_acceptance_length"] == e2e["expected_acceptance_length"] == 3
    assert e2e["acceptance_method"].startswith("controlled: each round accepts a drawn number of drafts")
    assert {r["k"] for r in report.rows(result, "policy")} <= {0, 2}
    assert round_costs_from_benchmark(out) == {1: {2: round_["overhead_ratio"]}}  # what jspec.policy reads
    assert out.with_suffix(".png").exists()


def test_spec_quantizes_the_target_and_the_drafter_with_weights(tmp_path):
    """--weights int4-g32: an int4 EAGLE-3 head on an int4 target, the round's bound from packed bytes."""
    out = tmp_path / "spec.json"
    _bench("spec", "--tiny", "--out", out, "--drafter", "eagle3", "--weights", "int4-g32", "--stages-k", "--alpha")
    (round_,) = report.rows(_result(out), "round")
    assert round_["weights"] == "int4-g32" and round_["overhead_ratio"] > 0
    with pytest.raises(SystemExit, match="quantized weights are not placed on a mesh"):
        _bench("spec", "--tiny", "--out", out, "--weights", "int8", "--tp", "2")


def test_spec_tiny_end_to_end_at_the_policys_k(tmp_path, monkeypatch):
    """``--k-end-to-end policy``: the k jspec.policy picks from the run's own round rows for a static
    batch of --new-tokens; where it picks 0 (forced at alpha 0 here: on a CPU a tiny round may cost
    less than a step) the row is plain decoding, speed-up 1, beside the rows of a given k."""
    from jspec.bench import spec
    from jspec.policy import choose_for_batch

    def plain_at_alpha_0(costs_by_batch, batch, alpha, **kwargs):
        return 0 if alpha == 0.0 else choose_for_batch(costs_by_batch, batch, alpha, **kwargs)

    monkeypatch.setattr(spec, "choose_for_batch", plain_at_alpha_0)
    out = tmp_path / "spec.json"
    _bench("spec", "--tiny", "--out", out, "--drafter", "eagle3", "--stages-k", "--alpha", "0", "0.8",
           "--k-end-to-end", "2", "policy")
    rows = {(r["alpha"], r["k_source"]): r for r in report.rows(_result(out), "end_to_end")}
    assert set(rows) == {(alpha, source) for alpha in (0.0, 0.8) for source in ("given", "policy")}
    assert rows[0.0, "given"]["k"] == rows[0.8, "given"]["k"] == 2
    chosen = rows[0.8, "policy"]
    assert chosen["k"] == choose_for_batch(round_costs_from_benchmark(out), 1, 0.8, new_tokens=28)
    assert ("spec_1_token" in chosen["timings"]) == (chosen["k"] > 0)  # speculative only at k >= 1
    plain = rows[0.0, "policy"]
    assert (plain["k"], plain["speedup"], plain["mean_acceptance_length"]) == (0, 1.0, 1.0)
    assert plain["spec_tokens_per_s"] == plain["plain_tokens_per_s"]
    assert set(plain["timings"]) == {"plain_1_token", "plain_28_tokens"}
    assert out.with_suffix(".png").exists()


def test_spec_policy_needs_round_costs_and_a_controlled_alpha(tmp_path, monkeypatch):
    """``policy`` beside numbers in --k-end-to-end; without --k values or at --alpha -1 the policy
    has nothing to choose from: a ValueError before any model is made."""
    from jspec.bench import spec

    args = cli.parser().parse_args(["spec", "--out", "x", "--k-end-to-end", "4", "policy"])
    assert args.k_end_to_end == [4, "policy"]
    monkeypatch.setattr(spec, "load_target", lambda *args, **kwargs: pytest.fail("a model was made"))
    out = tmp_path / "spec.json"
    with pytest.raises(ValueError, match="give --k"):
        _bench("spec", "--tiny", "--out", out, "--k", "--k-end-to-end", "policy")
    with pytest.raises(ValueError, match="controlled alpha"):
        _bench("spec", "--tiny", "--out", out, "--k-end-to-end", "policy", "--alpha", "-1")


def test_compile_tiny(tmp_path):
    out = tmp_path / "compile.json"
    _bench("compile", "--tiny", "--out", out)
    rows = report.rows(_result(out), "compile")
    assert [(r["k"], r["warm_up"]) for r in rows] == [(1, True), (2, False)]
    assert all(r["total_s"] > r["trace_lower_s"] > 0 for r in rows)


def test_catch_up_tiny(tmp_path):
    """EAGLE-3 rounds (a chain and a tree, the tree's propose and verify timed alone) and the
    catch-up variants."""
    out = tmp_path / "catch_up.json"
    _bench("catch-up", "--tiny", "--out", out, "--ks", "2", "--catch-up-ks", "3")  # not the tiny default 2
    result = _result(out)
    rounds = report.rows(result, "round")
    assert [(r["k"], r.get("topk")) for r in rounds] == [(2, None), (3, 2)]  # the chain, the tiny tree 2:2:3
    assert rounds[1]["propose_ms"] > 0 and rounds[1]["verify_ms"] > 0  # a tree's draft time, timed alone
    rows = report.rows(result, "catch_up")
    assert [r["k"] for r in rows] == [3]
    assert all(set(r["timings"]) == set(catch_up.VARIANTS) and r["unsliced_over_sliced"] > 0 for r in rows)


def test_frozen_kv_tiny(tmp_path):
    """The Gemma 4 assistant: a round vs a decode step (a chain and a tree), the seed folded vs
    separate (same drafts, checked by the command), end to end with acceptance controlled to a
    target acceptance length."""
    out = tmp_path / "frozen_kv.json"
    _bench("frozen-kv", "--tiny", "--out", out)
    result = _result(out)
    round_, tree_round = report.rows(result, "round")
    assert round_["k"] == 2 and round_["drafter"] == "frozen_kv_mtp" and {"propose", "verify"} <= set(round_["timings"])
    assert (tree_round["topk"], tree_round["depth"], tree_round["k"]) == (2, 2, 3) and tree_round["round_ms"] > 0
    (propose,) = report.rows(result, "propose")
    assert set(propose["timings"]) == {"folded", "separate", "separate_synced"} and propose["folded_ms"] > 0
    (e2e,) = report.rows(result, "end_to_end")
    assert (e2e["k"], e2e["target_acceptance_length"]) == (2, 2.5)
    # A tiny run's plain tokens/s is a difference of two short timings: on a busy CPU its sign is noise.
    assert abs(e2e["expected_acceptance_length"] - 2.5) < 1e-9 and np.isfinite(e2e["speedup"])
    assert out.with_suffix(".png").exists()


def test_invariant_tiny_speculative_equals_plain_and_self_drafting_accepts_everything(tmp_path):
    """Under impl="invariant" the drafters' speculative greedy output is plain greedy output on a
    ragged batch (bf16, kernels interpreted on CPU), and self-drafting accepts every draft. (Every
    drafter's bitwise equality in invariant mode: tests/test_invariant.py; here the command.)"""
    out = tmp_path / "invariant.json"
    # the first prompt decodes alike alone and among three (batch 1 beside the tiny batch of 3)
    assert _bench("invariant", "--tiny", "--out", out, "--impl", "invariant", "--drafters", "draft-model",
                  "--batch", "3", "1") == 0  # 1 on any differing token
    alone, row = report.rows(_result(out), "invariant")
    assert (row["drafter"], row["impl"], row["draft"], row["prompt_lengths"]) == ("draft-model", "invariant",
                                                                                   "tiny-draft", [12, 10, 8])
    assert row["num_tokens"] == 48 and row["differing_tokens"] == 0 and row["first_difference"] is None
    assert (alone["batch"], row["batch"]) == (1, 3) and "first_prompt_vs_batch" not in alone
    assert alone["differing_tokens"] == 0
    assert row["first_prompt_vs_batch"] == dict(batch=1, num_tokens=16, differing_tokens=0, sequences_differing=0,
                                                first_difference=None)
    # draft trees: top-2, depth 2, 4 nodes; self-drafting accepts the whole depth every round
    assert _bench("invariant", "--tiny", "--out", out, "--impl", "invariant", "--drafters", "self",
                  "--tree", "2:2:4") == 0
    (row,) = report.rows(_result(out), "invariant")
    assert (row["drafter"], row["batch"], row["topk"], row["depth"], row["nodes"]) == ("self", 3, 2, 2, 4)
    assert row["differing_tokens"] == 0 and row["all_drafts_accepted"]
    assert row["mean_acceptance_length"] == 3  # depth + 1 per round


def test_kernels_all_tiny_then_plot_and_merge(tmp_path):
    """check (the kernels interpreted on CPU, a small case of each), copy bandwidth, decode attention,
    gather rows; then the file actions on what it wrote."""
    assert _bench("kernels", "all", "--tiny", "--out", tmp_path) == 0
    check = _result(tmp_path / "decode_attention_check.json")
    assert check["command"] == "kernels check" and check["rows"]
    assert all(r["passed"] for r in report.rows(check, "check"))
    # one case a kernel; split-merge's case is a shape merged both ways (by the last split, by the combine kernel)
    names = [r["name"].split("_")[0] for r in report.rows(check, "check")]
    assert names == ["tree40", "split", "split", "gather", "add", "skinny", "rope", "swapped"]
    attention = _result(tmp_path / "decode_attention.json")
    rows = report.rows(attention, "decode_attention")
    assert {r["set"] for r in rows} == {"grid", "ragged", "qscan"}
    assert all(r["tb_s"]["pallas"] > 0 and r["tb_s"]["xla"] > 0 for r in rows)
    assert all(r["speedup_vs_xla"] > 0 for r in report.rows(_result(tmp_path / "gather_rows.json"), "gather_rows"))

    assert _bench("kernels", "plot", tmp_path / "decode_attention.json", tmp_path / "again.png") == 0
    assert (tmp_path / "again.png").exists()
    merged = tmp_path / "merged.json"
    _bench("kernels", "merge", merged, tmp_path / "decode_attention.json", tmp_path / "decode_attention.json")
    merged = report.validate(json.loads(merged.read_text()))
    assert len(report.rows(merged, "run")) == 2 and len(report.rows(merged, "decode_attention")) == len(rows)


def test_matmul_tiny(tmp_path):
    """Correctness and auto routing of the skinny matmul, and its measurement, on CPU."""
    _bench("matmul", "--tiny", "--out", tmp_path)
    result = _result(tmp_path / "skinny_matmul.json")
    cases = report.rows(result, "correctness")
    assert cases and all(case["ok"] for case in cases)
    assert [r["m"] for r in report.rows(result, "auto_routing")] == [4, 256]
    assert all(r["tb_s"]["xla"] > 0 and r["tb_s"]["kernel_default"] > 0 for r in report.rows(result, "matmul"))


def test_validate_names_what_breaks_the_schema():
    good = {"schema": report.SCHEMA, "command": "spec", "argv": ["spec"],
            "environment": dict.fromkeys(report.ENVIRONMENT_KEYS),
            "rows": [{"measure": "round", "timings": {"round": Timing.of([1.0, 2.0, 3.0]).as_dict()}}]}
    assert report.validate(good) is good
    bad = [
        ({"schema": "jspec.bench/0"}, "schema"),
        ({"environment": {"device": "cpu"}}, "environment lacks"),
        ({"rows": [{"k": 2}]}, "no 'measure'"),
        ({"rows": [{"measure": "round", "timings": {"round": {"median_ms": 1.0}}}]}, "p10_<unit>"),
        ({"rows": [{"measure": "round", "timings": {"round": dict(median_ms=1, p10_ms=2, p90_ms=3, repeats=2)}}]},
         "p10 <= median"),
        ({"results": []}, "unknown top-level"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            report.validate(dict(good, **change))


def test_timing_spread_and_per_call():
    t = Timing.of([4.0, 1.0, 2.0, 3.0, 5.0], calls_per_sample=2)
    assert (t.median_s, t.repeats) == (3.0, 5) and t.p10_s < t.median_s < t.p90_s
    d = t.per(2).as_dict("s")
    assert d["median_s"] == 1.5 and d["calls_per_sample"] == 2


def test_tiny_keeps_what_was_asked_and_only_tiny_presets():
    args = cli.parser().parse_args(["spec", "--tiny", "--out", "x", "--target", "qwen3-8b", "--k", "1", "3", "--alpha"])
    apply_tiny(args)
    assert (args.target, args.draft, args.k, args.alpha, args.repeats) == ("tiny", "tiny-draft", [1, 3], [], 2)
    args = cli.parser().parse_args(["spec", "--tiny", "--out", "x", "--target", "tiny-gemma4"])
    apply_tiny(args)
    assert (args.target, args.k, args.alpha) == ("tiny-gemma4", [2], [0.8])
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["decode", "--out", "x", "--impl", "fast"])
    assert cli.parser().parse_args(["decode", "--out", "x", "--impl", "xla", "auto,skinny_matmul=xla"]).impl == [
        "xla", "auto,skinny_matmul=xla"]
    assert cli.parser().parse_args(["matmul", "--trials", "3"]).repeats == 3  # the flag's old name


def test_the_l2_flush_reads_its_buffer_and_writes_little():
    """A flush that wrote its buffer would leave dirty lines whose write-back the timed call pays."""
    from jspec.bench.timing import _l2_flush

    assert jax.block_until_ready(_l2_flush(4 << 20)()).nbytes == (4 << 20) // 256


def test_gpu_kernel_times_is_empty_off_a_gpu():
    assert gpu_kernel_times(lambda: jnp.ones(3) + 1, flush_l2_bytes=1 << 10) == []
    assert interleaved_gpu_times({"a": lambda: jnp.ones(3)}, flush_l2_bytes=1 << 10) == {"a": []}


def test_a_kernels_time_is_what_it_adds_beyond_the_kernels_before_it():
    """A dependent kernel launched early (PDL) overlaps its predecessor and waits for it: only
    the time past the predecessor's end is its own; the times sum to the GPU's busy time."""
    events = [(100, "b", 50), (0, "a", 120), (200, "c", 10), (205, "d", 3), (300, "e", 20)]  # (start, name, ns)
    got = own_times(events)
    assert [name for name, _ in got] == ["a", "b", "c", "d", "e"]
    np.testing.assert_allclose([seconds * 1e9 for _, seconds in got], [120, 30, 10, 0, 20])
    assert sum(seconds for _, seconds in got) * 1e9 == pytest.approx(120 + 30 + 10 + 20)


def test_catch_up_variants_match_the_librarys():
    """The unsliced variants (bench only) leave the same cache and give the same kept hidden
    state and draft logits as the library's sliced catch-up."""
    target = tiny_model(0)
    drafter = Eagle3(eagle3_head(1, target, aux=(0, 1, 1))).bind(target)
    batch, k, context = 3, 3, 5
    inputs = catch_up.catch_up_inputs(drafter, target, batch, k, context, jnp.float32)
    results = {name: jax.jit(variant)(drafter, catch_up.draft_cache(drafter, batch, 16, context, jnp.float32), *inputs)
               for name, variant in catch_up.VARIANTS.items()}
    (kv, hidden, logits) = results.pop("sliced")
    assert (np.asarray(kv.lengths) == context + np.arange(batch) % (k + 1) + 1).all()
    for other_kv, other_hidden, other_logits in results.values():
        np.testing.assert_array_equal(other_kv.lengths, kv.lengths)
        np.testing.assert_allclose(other_kv.k[0], kv.k[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(other_hidden, hidden, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(other_logits, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma-4-31b", "gemma-4-e4b"])
def test_presets_have_the_published_size(name):
    """Parameter counts from abstract shapes (no weights made): 31B dense; E4B ~8B with PLE."""
    model = abstract_target(name, jnp.bfloat16)
    params = sum(x.size for x in jax.tree.leaves(model))
    expected = {"gemma-4-31b": (30e9, 32e9), "gemma-4-e4b": (7e9, 8.5e9)}[name]
    assert expected[0] < params < expected[1], params
    # The tied embedding is read whole by the LM head; the PLE table only at the looked-up rows.
    lookup_only = 0 if model.ple is None else model.ple.embed.size
    assert weight_bytes_per_step(model) == 2 * (params - lookup_only)


def test_kv_bytes_count_each_layer_shape_and_window():
    model = abstract_target(TINY_GEMMA4, jnp.bfloat16)
    # per row and sequence: sliding 2x16, full 1x32 values, K and V, 2 bytes; 4 layers (2 of each
    # type, the KV-shared ones included), sliding layers read at most 5 rows.
    per_row = {"sliding": 2 * 2 * 16 * 2, "full": 2 * 1 * 32 * 2}
    assert kv_bytes_per_step(model, 3, 100) == 2 * 3 * (per_row["sliding"] * 5 + per_row["full"] * 100)
    assert kv_bytes_per_step(model, 1, 4) == 2 * 4 * (per_row["sliding"] + per_row["full"])


def test_a_rounds_roofline_adds_what_the_drafter_must_read_to_a_step_and_its_propose_reads_the_drafts():
    from jspec.bench.roofline import draft_bytes_per_round, propose_bytes, round_roofline_ratio
    from jspec.drafters import DraftModel, NGram

    target, draft = tiny_model(0), tiny_model(1, num_layers=1)
    head = eagle3_head(2, target)
    nbytes = lambda *trees: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trees))  # noqa: E731
    per_draft = nbytes(head.layer, head.norm, head.hidden_norm, head.lm_head)  # a layer and the draft LM head
    assert draft_bytes_per_round(Eagle3(head), 3) == 3 * per_draft + nbytes(head.fc)  # fc once
    # the propose alone: three draft LM heads, two layers (the first draft's layer ran in the last commit)
    assert propose_bytes(Eagle3(head), 3) == (3 * nbytes(head.norm, head.lm_head)
                                              + 2 * nbytes(head.layer, head.hidden_norm))
    assert propose_bytes(DraftModel(draft), 3) == 3 * weight_bytes_per_step(draft) and propose_bytes(NGram(), 3) == 0
    assert draft_bytes_per_round(DraftModel(draft), 3) == 3 * weight_bytes_per_step(draft)
    assert draft_bytes_per_round(NGram(), 3) == 0 and round_roofline_ratio(target, NGram(), 3, 2, 16) == 1.0
    step = weight_bytes_per_step(target) + kv_bytes_per_step(target, 2, 16)
    assert round_roofline_ratio(target, DraftModel(draft), 3, 2, 16) == pytest.approx(
        1 + 3 * weight_bytes_per_step(draft) / step)


def test_confident_keeps_the_residual_stream_on_the_input_token():
    """With the branch outputs scaled down, a tied-head Gemma predicts its input token, in bf16."""
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_gemma4())
    ids = np.arange(40).reshape(2, 20)
    assert (np.argmax(jspec.score(confident(model), ids), -1) == ids).all()


def test_gguf_quality_tiny_a_packed_file_scores_as_its_fp32_dequantization(tmp_path):
    """A tiny Q4_1 / Q8_0 GGUF kept packed: its perplexity is the fp32 dequantization's (within fp32
    noise), in under a quarter of the bytes."""
    out = tmp_path / "gguf.json"
    _bench("gguf-quality", "--tiny", "--out", out)
    result = _result(out)
    ppl = {r["variant"]: r for r in report.rows(result, "perplexity")}
    assert ppl["jspec-packed"]["perplexity"] == pytest.approx(ppl["jspec-fp32"]["perplexity"], rel=1e-5)
    assert ppl["jspec-fp32"]["perplexity"] < 1000  # a tiny model's table of 256 ids, near uniform
    (memory,) = report.rows(result, "memory")
    assert memory["packed_bytes"] < memory["dequantized_bytes"] / 4
    assert {r["variant"] for r in report.rows(result, "decode")} == {"jspec-packed", "jspec-fp32"}
    assert out.with_suffix(".png").is_file()


def test_accept_summary_compares_jspec_with_the_hf_peer_per_experiment_and_k():
    from jspec.bench import accept

    rows = [dict(measure="jspec", experiment="e", prompt=p, k=3, acceptance_length=al, identical=True)
            for p, al in (("a", 2.0), ("b", 3.0))]
    rows += [dict(measure="hf", experiment="e", prompt=p, k=3, acceptance_length=al, tokens_per_s=5.0,
                  equals_jspec=eq) for p, al, eq in (("a", 2.0, True), ("b", 2.0, False))]
    rows.append(dict(measure="speed", experiment="e", k=3, batch=2, tokens_per_s=10.0, plain_tokens_per_s=8.0,
                     batch1_tokens_per_s=6.0, batch1_plain_tokens_per_s=4.0))
    (row,) = accept.summary(rows)
    assert row["acceptance_length"] == 2.5 and row["hf_acceptance_length"] == 2.0
    assert row["all_identical_to_plain"] and not row["all_equal_to_hf"]
    assert row["tokens_per_s"] == 10.0 and row["prompts"] == 2
    assert len(accept.prompt_set()) >= 8  # the committed prompt set


def test_tensor_parallel_runs_let_jax_take_most_of_each_gpu(monkeypatch):
    """A 70B-shaped target's share on two 80 GB GPUs exceeds JAX's default 75% preallocation."""
    from jspec.bench import cli

    for name in cli.TENSOR_PARALLEL_MEMORY:
        monkeypatch.delenv(name, raising=False)
    cli.prepare_environment(cli.parser().parse_args(["decode", "--out", "d.json", "--tp", "1"]))
    assert not any(name in os.environ for name in cli.TENSOR_PARALLEL_MEMORY)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # the user's choice wins
    cli.prepare_environment(cli.parser().parse_args(["decode", "--out", "d.json", "--tp", "2"]))
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_a_kernel_profile_groups_kernels_by_name_and_counts_collectives_apart(monkeypatch):
    from jspec.bench import decode

    kernels = [("gemv", 1e-3), ("attention", 2.5e-3), ("gemv", 1e-3), ("ncclAllReduce_sum", 5e-4), ("gemv", 1e-3),
               ("psum_484_0_fusion_1", 2e-4), ("all_reduce_1_fusion_1", 1e-4), ("loop_reduce_fusion_94", 1e-4)]
    monkeypatch.setattr(decode, "gpu_kernel_times", lambda call, warmup: kernels)
    profile = decode.kernel_profile(lambda: None, top=2)
    assert profile["kernels"] == 8 and profile["gpu_ms"] == pytest.approx(6.4)
    assert profile["collective_ms"] == pytest.approx(0.8)  # NCCL's and XLA's own all-reduce kernels
    assert [(k["name"], k["count"]) for k in profile["top_kernels"]] == [("gemv", 3), ("attention", 1)]
    monkeypatch.setattr(decode, "gpu_kernel_times", lambda call, warmup: [])  # off a GPU
    assert decode.kernel_profile(lambda: None) is None


def test_tokamax_peers_get_their_own_layout_and_the_lengths(monkeypatch):
    """The tokamax peers (jspec.bench.peers) compute what our kernels compute, given tokamax's
    layouts: attention over [batch, seq, heads, head_dim] with per-sequence lengths, a matmul as
    one group of a grouped matmul. A stand-in with tokamax's signatures checks the wiring here; off
    a GPU no peer is offered."""
    from types import SimpleNamespace

    from jspec.bench import peers
    from jspec.bench.kernel_check import decode_attention_inputs
    from pallas_kernels.attention.decode_attention import decode_attention_reference

    assert peers.available(peers.ATTENTION) == [] and peers.available(peers.MATMUL) == []  # CPU
    calls = []

    def dot_product_attention(q, k, v, *, key_value_seq_lengths, implementation):
        calls.append(implementation)
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=key_value_seq_lengths)

    def ragged_dot(lhs, rhs, group_sizes, *, implementation):
        calls.append(implementation)
        assert rhs.shape[0] == 1 and int(group_sizes.sum()) == lhs.shape[0]
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    monkeypatch.setattr(peers, "tokamax", lambda: SimpleNamespace(dot_product_attention=dot_product_attention,
                                                                 ragged_dot=ragged_dot))
    q, k, v, lengths, positions = decode_attention_inputs(2, 1, 8, 2, 64, 32, [64, 23], seed=0, dtype=jnp.float32)
    expected = decode_attention_reference(q, k, v, lengths, q_positions=positions)
    for name in peers.ATTENTION:
        out = peers.attention(name)(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lengths)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
    x, w = jax.random.normal(jax.random.key(0), (5, 48)), jax.random.normal(jax.random.key(1), (48, 40))
    for name in peers.MATMUL:
        np.testing.assert_allclose(np.asarray(peers.matmul(name)(x, w)), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
    assert calls == ["mosaic", "triton", "triton", "mosaic"]


def test_a_tokamax_matmul_this_installation_lacks_is_not_offered(monkeypatch):
    """tokamax registers its Triton matmul only where ``jax_triton`` imports; asked for it otherwise
    it raises ValueError("Unknown implementation"): the benchmark leaves that peer out."""
    from types import SimpleNamespace

    from jspec.bench import peers

    def ragged_dot(lhs, rhs, group_sizes, *, implementation):
        if implementation == "triton":
            raise ValueError(f"Unknown implementation: {implementation}")
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    monkeypatch.setattr(peers, "tokamax", lambda: SimpleNamespace(ragged_dot=ragged_dot))
    peers._matmul_runs.cache_clear()
    try:
        assert peers.available(peers.MATMUL) == ["tokamax_mosaic"]
        assert peers.available(peers.ATTENTION) == list(peers.ATTENTION)
    finally:
        peers._matmul_runs.cache_clear()
