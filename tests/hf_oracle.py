"""Calls the HF reference environment (``tests/hf_reference``, a folder Python runs) as a subprocess.

The reference environment is a separate Python 3.11 venv with torch + transformers
(``.venv-ref`` at the repo root, made by ``scripts/setup.sh``; override with
``JSPEC_HF_PYTHON``). Parity tests must run in CI, so a missing environment is an error,
not a skip.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "hf_reference"


def reference_python() -> Path:
    python = Path(os.environ.get("JSPEC_HF_PYTHON", ROOT / ".venv-ref" / "bin" / "python"))
    if not python.exists():
        raise RuntimeError(
            f"HF reference environment not found at {python}: run scripts/setup.sh "
            "(or set JSPEC_HF_PYTHON to a Python with torch and transformers)"
        )
    return python


def run(*args: str) -> None:
    proc = subprocess.run([str(reference_python()), str(SCRIPT), *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"tests/hf_reference {' '.join(args)} failed:\n{proc.stderr[-4000:]}")


def make(kind: str, out_dir: Path) -> Path:
    """Write tiny HF checkpoints + reference outputs of one kind into ``out_dir``: ``models``
    (Llama 3 / Qwen2 / Qwen3), ``eagle3`` (heads + their Llama target under ``target/``), ``mtp``
    (targets carrying one MTP layer), ``gemma4`` (incl. the multimodal layout), ``gemma4-assistant``
    (Gemma 4 assistants, their targets and draft rounds) or ``gguf`` (tiny GGUF files read back by
    transformers' GGUF loader); the cases are listed in tests/hf_reference/."""
    run(kind, str(out_dir))
    return out_dir


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """The directory ``make(directory)`` fills, made once per test run rather than once per xdist
    worker (a session or module fixture is per process, and a module's tests run on every worker):
    the first worker to ask makes it under a lock in the run's shared temporary directory, the
    others wait for it and read the same files. Only for directories the tests read, never write."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / ".complete").exists():
            shutil.rmtree(out, ignore_errors=True)  # what a failed attempt left
            out.mkdir()
            make(out)
            (out / ".complete").touch()
    return out
