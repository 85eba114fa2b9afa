"""Calls the HF reference environment (``tests/hf_reference.py``) as a subprocess.

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
SCRIPT = ROOT / "tests" / "hf_reference.py"


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
        raise RuntimeError(f"hf_reference.py {' '.join(args)} failed:\n{proc.stderr[-4000:]}")


def make_models(out_dir: Path) -> Path:
    run("models", str(out_dir))
    return out_dir


def make_eagle3(out_dir: Path) -> Path:
    """EAGLE-3 heads (tests/hf_reference.py EAGLE3_CASES) + their Llama target under ``target/``."""
    run("eagle3", str(out_dir))
    return out_dir


def make_mtp(out_dir: Path) -> Path:
    """Targets carrying one MTP layer (tests/hf_reference.py MTP_CASES)."""
    run("mtp", str(out_dir))
    return out_dir


def make_gemma4(out_dir: Path) -> Path:
    """Tiny Gemma 4 checkpoints (tests/hf_reference.py GEMMA4_CASES and the multimodal layout)."""
    run("gemma4", str(out_dir))
    return out_dir
