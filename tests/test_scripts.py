"""The entry points as a user runs them: --help of each, the README's commands, the main job on
SmolLM2-135M-Instruct, and every bad command line a one-line error before any compute. (The
benchmarks' tiny runs are in test_bench.py.)"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "checkpoints" / "tiny-llama3"  # random weights, vocab 160, 256 positions, no tokenizer


def _run(*args, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def _ok(*args, **kwargs) -> str:
    proc = _run(*args, **kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generate():
    return _script("generate")


@pytest.fixture(scope="module")
def train_draft():
    return _script("train_draft")


@pytest.mark.parametrize("script, expected",
                         [("bench.py", "catch-up"), ("convert_hf.py", "SRC"), ("generate.py", "--drafter"),
                          ("train_draft.py", "--resume")])
def test_help(script, expected):
    out = _ok(ROOT / "scripts" / script, "--help")
    assert out.startswith("usage") and expected in out


def test_generate_help_says_bfloat16_speculation_is_not_exact_yet():
    assert "bfloat16 speculation is not exact yet" in " ".join(_ok(ROOT / "scripts" / "generate.py", "--help").split())


def test_main_job_on_smollm2_with_ngram_and_the_shipped_eagle3_head_and_dflash_draft(smollm2_gguf):
    """The default model and prompt: the answer as text, then speculative decoding with each drafter,
    identical to plain decoding. (One process: the model loads and plain decoding compiles once.)"""
    out = _ok(ROOT / "scripts" / "generate.py", "--max-new-tokens", "12", "--drafter", "ngram", "eagle3", "dflash")
    assert "target smollm2-135m-instruct: " in out
    plain, *sections = re.split(r"\nspeculative decoding, (\w+): ", out)
    text = [line for line in plain.splitlines() if line.startswith("  | ")]
    assert text and any(c.isalpha() for c in "".join(text)), out  # the model's answer, as text
    assert re.search(r"plain decoding: 12 tokens in .* s, [\d.]+ tokens/s", plain)
    specs = dict(zip(sections[::2], sections[1::2]))
    assert list(specs) == ["ngram", "eagle3", "dflash"]
    for spec in specs.values():
        spec = spec.split("\n\n")[0]  # up to the next drafter's
        assert "identical to plain decoding: yes" in spec
        assert re.search(r"mean acceptance length \(.*\): \d+\.\d\d", spec)
        assert re.search(r"^[\d.]+ tokens/s \([\d.]+x plain\)", spec.split(", ", 1)[1])


class _Killed(Exception):
    """A training process ended by force."""


# MTP and DFlash: the target's whole vocabulary
@pytest.mark.parametrize("drafter, vocab", [("eagle3", 1024), ("mtp", 49152), ("dflash", 49152)])
def test_train_draft_trains_exports_and_resumes_on_smollm2(train_draft, smollm2_gguf, tmp_path, capsys, monkeypatch,
                                                          drafter, vocab):
    """A tiny training run on stdlib source: progress, held-out acceptance, a loadable HF head.
    The EAGLE-3 run is killed after its step-2 checkpoint; run again with --resume, it continues
    from there (one head: resuming restores whatever pytree the checkpoint holds). The script's
    main runs in this process, so the resumed run reuses the compiled training step."""
    args = ["--out", tmp_path, "--drafter", drafter, "--data", "stdlib", "--stdlib-bytes", "20000", "--width", "64",
            "--batch", "2", "--ttt", "2", "--anchors", "4", "--draft-vocab", "1024", "--eval-every", "0",
            "--eval-prompts", "1", "--eval-tokens", "16", "--checkpoint-every", "2",
            "--eval-k", "1"]  # one draft a round: the held-out evaluation's rounds verify 2 rows, not 5
    args = [str(a) for a in args]
    if drafter == "eagle3":
        from jspec import training

        train = training.train

        def killed_after_step_2(*train_args, num_steps, **kwargs):
            train(*train_args, num_steps=2, **kwargs)  # the callback writes the step-2 checkpoint
            raise _Killed

        monkeypatch.setattr(training, "train", killed_after_step_2)
        with pytest.raises(_Killed):
            train_draft.main([*args, "--train-steps", "4"])
        monkeypatch.undo()
        assert "2/4" in capsys.readouterr().err
        assert not (tmp_path / "head").exists()
        assert train_draft.main([*args, "--train-steps", "4", "--resume"]) == 0
        out, err = capsys.readouterr()
        assert "2/4" in err and "0/4" not in err  # the progress bar starts where the checkpoint left off
    else:
        assert train_draft.main([*args, "--train-steps", "2"]) == 0
        out = capsys.readouterr().out
    assert re.search(r"held-out acceptance length \d+\.\d\d", out)
    import jax
    import jax.numpy as jnp

    from jspec.drafters import MTP, DFlash, Eagle3

    head = {"eagle3": Eagle3, "mtp": MTP, "dflash": DFlash}[drafter].load(tmp_path / "head").head
    assert {x.dtype.name for x in jax.tree.leaves(head) if jnp.issubdtype(x.dtype, jnp.floating)} == {"bfloat16"}
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config.get("draft_vocab_size", config["vocab_size"]) == config["jspec"]["draft_vocab"] == vocab
    assert config["jspec"]["steps"] == (4 if drafter == "eagle3" else 2)


@pytest.mark.parametrize("argv, message", [
    (["--anchors", "65", "--width", "64"], "--anchors 65: more than the --width 64 rows"),
    (["--drafter", "dflash", "--block-size", "4", "--eval-k", "4"], "--eval-k 4: a DFlash block of --block-size 4"),
    (["--init", "nowhere"], "--init nowhere: no config.json there"),
])
def test_train_draft_bad_command_line_is_a_one_line_error_before_loading(tmp_path, argv, message):
    proc = _run(ROOT / "scripts" / "train_draft.py", "--out", tmp_path, *argv)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


def test_train_draft_starts_from_an_init_head_and_refuses_one_of_another_kind(train_draft, tmp_path):
    """--init: training starts from an exported head's shapes and weights (its DFlash mask token too);
    an EAGLE-3 run given a DFlash head is refused (a ValueError, which main prints as one line)."""
    import argparse

    import jax
    import numpy as np

    from jspec.drafters import dflash as dflash_module
    from tests.tiny import dflash, tiny_model

    target = tiny_model(0, num_layers=4)
    exported = dflash(target, block_size=4, ids=(1, 3)).head
    dflash_module.save_head(exported, tmp_path / "head")
    args = argparse.Namespace(drafter="dflash", init=tmp_path / "head")
    drafter, save_head = train_draft.new_drafter(args, target, None, [], jax.random.key(0), np.float32)
    assert save_head is dflash_module.save_head and drafter.config == exported.config
    for got, want in zip(jax.tree.leaves(drafter.head), jax.tree.leaves(exported)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError):
        train_draft.new_drafter(argparse.Namespace(drafter="eagle3", init=tmp_path / "head"), target, None, [],
                                jax.random.key(0), np.float32)


def test_token_id_mode_without_a_tokenizer(generate, capsys):
    generate.main(["--model", str(TINY), "--tokens", "5 17 42 8 99 3 61 5 17 42", "--tokens", "7 120",
                   "--max-new-tokens", "8", "--eos-id", "2", "--impl", "xla"])
    out = capsys.readouterr().out
    assert out.count("identical to plain decoding: yes") == 1
    assert "[0] " not in out and re.search(r"^  \[\d+(, \d+)*\]", out, re.M)  # ids, one line per prompt


def test_a_converted_checkpoint_generates_from_text(generate, tmp_path, capsys):
    """The two commands a new user runs: convert a checkpoint that has a tokenizer, then generate
    from the converted directory with a text prompt, which reaches the model as the source
    tokenizer's chat ids."""
    from jspec.text import Tokenizer
    from tests.tiny import write_tiny_hf_tokenizer

    shutil.copytree(TINY, tmp_path / "src")
    write_tiny_hf_tokenizer(tmp_path / "src")
    _ok(ROOT / "scripts" / "convert_hf.py", tmp_path / "src", tmp_path / "converted")
    prompt = "what is speculative decoding ?"
    generate.main(["--model", str(tmp_path / "converted"), "--prompt", prompt, "--max-new-tokens", "6",
                   "--impl", "xla"])
    out = capsys.readouterr().out
    ids = Tokenizer.from_pretrained(tmp_path / "src").encode_chat([{"role": "user", "content": prompt}])
    assert f"prompt ({len(ids)} tokens):" in out
    assert "identical to plain decoding: yes" in out and re.search(r"^  \| ", out, re.M)


# Each bad command line: exit code 2 and one line on stderr, before any compute.
BAD_COMMAND_LINES = {
    "unknown dtype": (["--dtype", "float64"], "invalid choice: 'float64'"),
    "k < 1": (["--num-draft-tokens", "0"], "must be >= 1"),
    "k not an int": (["-k", "two"], "expected an integer"),
    "max-new-tokens < 1": (["--max-new-tokens", "0"], "must be >= 1"),
    "k too large": (["--model", TINY, "--tokens", "5 17", "-k", "300"], "--num-draft-tokens 300 is too large"),
    "a file where a directory is expected": (["--model", TINY / "config.json"], "config.json"),
    "a missing file": (["--model", TINY / "missing.gguf"], "missing.gguf"),
    "an unknown model name": (["--model", "no-such-model-135m"], "no-such-model-135m"),
    "an EOS id outside the vocabulary": (["--model", TINY, "--tokens", "5 17", "--eos-id", "160"],
                                         "--eos-id 160 is outside the vocabulary [0, 160)"),
    "a prompt id outside the vocabulary": (["--model", TINY, "--tokens", "5 160"], "outside the vocabulary"),
    "token ids that are not ints": (["--tokens", "5 x"], "expected space-separated integer token ids"),
    "text without a tokenizer": (["--model", TINY, "--prompt", "hello"], "--tokens"),
    "a negative temperature": (["--model", TINY, "--tokens", "5 17", "--temperature", "-1"], "temperature"),
    "a draft-model drafter without a draft": (["--drafter", "draft-model"], "needs --draft"),
    "a draft that no drafter uses": (["--draft", TINY, "--drafter", "ngram"], "does not include draft-model"),
    "--chat with token ids": (["--tokens", "5 17", "--chat"], "--chat"),
    "an unknown kernel choice": (["--impl", "fast"], "--impl"),
    "an unknown weights choice": (["--weights", "int3"],
                                  "--weights: expected 'file', 'bfloat16' or a quantization scheme"),
    "bfloat16 weights in another dtype": (["--weights", "bfloat16", "--dtype", "float32"],
                                          "--weights bfloat16 holds the weights in bfloat16, not --dtype float32"),
    "a group that does not divide K": (["--model", TINY, "--tokens", "5 17", "--weights", "int4"],
                                       "does not divide K"),
    "a head that no drafter uses": (["--head", TINY, "--drafter", "ngram"], "does not include eagle3"),
    "a head that is not a directory": (["--model", TINY, "--tokens", "5 17", "--drafter", "eagle3", "--head",
                                        TINY / "config.json"], "is not an EAGLE-3 head directory"),
    "a head for another target": (["--model", TINY, "--tokens", "5 17", "--drafter", "eagle3"], "vocab"),
    "a DFlash draft that no drafter uses": (["--dflash-head", TINY, "--drafter", "eagle3"], "does not include dflash"),
    "a DFlash draft that is not a directory": (["--model", TINY, "--tokens", "5 17", "--drafter", "dflash",
                                                "--dflash-head", TINY / "config.json"],
                                               "is not a DFlash draft directory"),
    "a DFlash draft for another target": (["--model", TINY, "--tokens", "5 17", "--drafter", "dflash"], "vocab"),
    "a tree without a depth": (["--topk", "2"], "--topk 2 drafts trees: give their --depth"),
    "a depth without a tree": (["--depth", "3"], "--depth shapes a tree"),
    "a tree of more nodes than its shape holds": (["--model", TINY, "--tokens", "5 17", "--topk", "2", "--depth", "2",
                                                   "-k", "7"], "num_nodes=7 exceeds the 6 candidates"),
    "a chain longer than a DFlash block": (["--drafter", "dflash", "-k", "8"], "--num-draft-tokens 8 exceeds the 7"),
    "a tree deeper than a DFlash block": (["--drafter", "dflash", "-k", "9", "--topk", "2", "--depth", "8"],
                                          "--depth 8 exceeds the 7 drafts a round of dflash makes"),
}


@pytest.mark.parametrize("argv, message", BAD_COMMAND_LINES.values(), ids=BAD_COMMAND_LINES.keys())
def test_bad_command_line_is_a_one_line_error(generate, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        generate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("generate.py: error: ") and message in err, err
    assert "plain decoding" not in out


def test_bad_command_line_in_a_fresh_process_prints_no_traceback():
    proc = _run(ROOT / "scripts" / "generate.py", "--model", TINY / "config.json")
    assert proc.returncode == 2 and proc.stderr.startswith("generate.py: error: ") and proc.stderr.count("\n") == 1


def _readme_block(language: str, after: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(rf"```{language}\n(.*?)```", readme[readme.index(after):], re.S).group(1)


def test_ci_runs_the_readme_test_command():
    commands = [line.split("#")[0].strip() for line in _readme_block("bash", "## Set up").splitlines()]
    assert len(commands) == 2 and commands[1].endswith("-m pytest")
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_api_example_runs_as_written_from_anywhere(smollm2_gguf, tmp_path):
    (tmp_path / "example.py").write_text(_readme_block("python", "## API"))
    _ok(tmp_path / "example.py", cwd=tmp_path)


@pytest.mark.parametrize("weights", ["file", "int8", "fp8", "int4-g32"])
def test_weights_packed_from_the_file_or_quantized_at_load(generate, tmp_path, capsys, weights):
    """A quantized GGUF with its own blocks kept packed, or a model quantized at load: speculation on it
    is still exact."""
    from tests.test_gguf_packed import tiny_model_file

    model = tiny_model_file(tmp_path / "tiny.gguf") if weights == "file" else TINY
    generate.main(["--model", str(model), "--tokens", "5 17 42 8 5 17 42", "--max-new-tokens", "6",
                   "--weights", weights, "--impl", "xla"])
    out = capsys.readouterr().out
    assert f"weights: {weights}," in out and "identical to plain decoding: yes" in out


def test_trees_from_the_command_line(generate, capsys):
    generate.main(["--model", str(TINY), "--tokens", "5 17 42 8 5 17 42", "--max-new-tokens", "6", "-k", "4",
                   "--topk", "2", "--depth", "3"])
    out = capsys.readouterr().out
    assert "ngram, k=4, a tree of topk 2, depth 3" in out and "identical to plain decoding: yes" in out


def test_a_gpu_runs_a_quantized_file_packed_by_default(generate, tmp_path, monkeypatch):
    import types

    import jax

    from tests.test_gguf_packed import tiny_model_file

    packable = tiny_model_file(tmp_path / "tiny.gguf")
    stuck = tiny_model_file(tmp_path / "q2k.gguf", retype={"blk.1.ffn_down.weight": "Q2_K"})  # cannot stay packed
    assert generate._default_weights(str(packable)) is None  # on the CPU: arrays, as before
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="gpu")])
    fp8 = tmp_path / "fp8"  # an HF checkpoint quantized by another tool: its config says so
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert [generate._default_weights(str(m)) for m in (packable, stuck, TINY, fp8)] == ["file", None, None, "file"]
