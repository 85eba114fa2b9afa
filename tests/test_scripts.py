"""The scripts run: --help of each entry point, and the demo of generate.py. (The benchmarks'
tiny runs are in test_bench.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, timeout=300):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script, expected",
                         [("bench.py", "catch-up"), ("convert_hf.py", "SRC"), ("generate.py", "--drafter")])
def test_help(script, expected):
    out = _run(ROOT / "scripts" / script, "--help")
    assert out.startswith("usage") and expected in out


def test_generate_default_model():
    out = _run(ROOT / "scripts" / "generate.py", "--max-new-tokens", "8", "--drafter", "ngram")
    assert "identical to plain decoding" in out
