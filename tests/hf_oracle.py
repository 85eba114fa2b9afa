"""Calls the HF reference environment (``tests/hf_reference``, a folder Python runs) as a subprocess.

The reference environment is a separate Python 3.11 venv with torch + transformers
(``.venv-ref`` at the repo root, made by ``scripts/setup.sh``; override with
``JSPEC_HF_PYTHON``). Parity tests must run in CI, so a missing environment is an error,
not a skip.
"""

from __future__ import annotations

import os
import subprocess
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
