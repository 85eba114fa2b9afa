"""orbax save/restore round trip (with a tokenizer beside the weights: its bad input here, its
round trip in test_text.py) and the HF conversion script."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from tests.tiny import tiny_model, write_tiny_hf_tokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_restore_is_bit_exact(tmp_path, dtype):
    model = jax.tree.map(lambda x: x.astype(dtype), tiny_model(qkv_bias=True, qk_norm=True, tie_word_embeddings=True))
    jspec.save(model, tmp_path / "m")
    restored = jspec.restore(tmp_path / "m")
    assert restored.config == model.config
    assert jax.tree.structure(restored) == jax.tree.structure(model)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def _assert_holds(path, model):
    restored = jspec.restore(path)
    assert restored.config == model.config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_save_refuses_to_overwrite_unless_asked(tmp_path):
    """Without ``overwrite`` a non-empty directory is a FileExistsError and keeps the first model;
    with it, the directory holds the second model bit-exactly (other weights and layer count)."""
    first, second = tiny_model(0), tiny_model(1, num_layers=1)
    jspec.save(first, tmp_path / "m")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        jspec.save(second, tmp_path / "m")
    _assert_holds(tmp_path / "m", first)
    jspec.save(second, tmp_path / "m", overwrite=True)
    _assert_holds(tmp_path / "m", second)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_an_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save that dies while writing the parameters (after the new config is written) leaves the
    old checkpoint whole and restorable, and no partial directory beside it."""
    import orbax.checkpoint as ocp

    old, new = tiny_model(0), tiny_model(1, num_layers=1)
    jspec.save(old, tmp_path / "m")
    real_save = ocp.StandardCheckpointer.save

    def dies_midway(self, directory, *args, **kwargs):
        real_save(self, directory, *args, **kwargs)
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        jspec.save(new, tmp_path / "m", overwrite=True)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    restored = jspec.restore(tmp_path / "m")
    assert restored.config == old.config
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jspec.save(new, tmp_path / "m", overwrite=True)  # an uninterrupted save replaces it
    assert jspec.restore(tmp_path / "m").config == new.config
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_convert_hf_script_end_to_end(hf_models, tmp_path):
    dst = tmp_path / "converted"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "convert_hf.py"), str(hf_models / "qwen3-sharded"), str(dst),
         "--dtype", "bfloat16", "--no-tokenizer"],  # transformers' tiny random checkpoints come without one
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert not (dst / "tokenizer.json").exists()
    restored = jspec.restore(dst)
    direct = jspec.load_hf(hf_models / "qwen3", dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_convert_hf_script_takes_the_tokenizer_from_the_source_or_says_where_else(tmp_path, capsys):
    """A source without a tokenizer is a one-line error naming --tokenizer and --no-tokenizer, with
    nothing written; ``--tokenizer SPEC`` takes it from SPEC. (The source's own tokenizer, and
    generating from what the script wrote: test_scripts.py.)"""
    spec = importlib.util.spec_from_file_location("convert_hf_script", ROOT / "scripts" / "convert_hf.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    tiny = ROOT / "checkpoints" / "tiny-llama3"  # no tokenizer
    with pytest.raises(SystemExit) as exit_:
        convert.main([str(tiny), str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "has no tokenizer.json" in err and "--tokenizer SPEC" in err and "--no-tokenizer" in err
    assert not (tmp_path / "a").exists()
    write_tiny_hf_tokenizer(tmp_path / "tokenizer")
    convert.main([str(tiny), str(tmp_path / "b"), "--tokenizer", str(tmp_path / "tokenizer")])
    assert "with its tokenizer" in capsys.readouterr().out
    given, saved = (jspec.Tokenizer.from_pretrained(tmp_path / d) for d in ("tokenizer", "b"))
    assert saved.encode_chat([{"role": "user", "content": "hello world"}]) == given.encode_chat(
        [{"role": "user", "content": "hello world"}])
    assert saved.eos_ids == given.eos_ids


def test_convert_hf_script_help():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_hf.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "SRC" in proc.stdout


@pytest.mark.parametrize("tokenizer, message", [
    (42, "tokenizer must be a jspec.Tokenizer.*got a int"),
    ({"eos_token": "</s>"}, "got a dict"),
    ("no/such/tokenizer.json", "no/such/tokenizer.json"),
    (ROOT / "checkpoints" / "tiny-llama3", "has no tokenizer.json"),
    ("tiny hf_dir", "has 34 ids but the model's vocabulary only 20"),
])
def test_a_bad_tokenizer_is_a_value_error_before_anything_is_written(tmp_path, tokenizer, message):
    """A tokenizer of another type, a missing one, a directory without one and another model's
    (more ids than the vocabulary) are each a ValueError naming it, and nothing is written."""
    if tokenizer == "tiny hf_dir":
        write_tiny_hf_tokenizer(tmp_path / "tokenizer")
        tokenizer = tmp_path / "tokenizer"
    before = set(tmp_path.iterdir())
    with pytest.raises(ValueError, match=message):
        jspec.save(tiny_model(vocab_size=20), tmp_path / "m", tokenizer=tokenizer)
    assert set(tmp_path.iterdir()) == before


@pytest.mark.parametrize("name", ["jspec_config.json", "params", "../beside.txt", "sub/file.txt", ".."])
def test_files_beside_a_checkpoint_have_plain_names_of_their_own(tmp_path, name):
    with pytest.raises(ValueError, match="plain file names"):
        jspec.io.save(tiny_model(), tmp_path / "m", files={name: "text"})
    assert list(tmp_path.iterdir()) == []
