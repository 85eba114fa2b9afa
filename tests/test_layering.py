"""The layering the folders tell (README.md, "Layout"), enforced with import-linter's contracts in
pyproject.toml: kernels import nothing from jspec; the library in layers (models never import
drafters, engine or the benchmark lab; the core never imports the lab); configs import no
kernels; the model families are independent of each other; no import cycle anywhere (imports
inside functions included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# In a subprocess: import-linter's command line takes over the process's output streams.
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def test_import_contracts_are_kept():
    proc = subprocess.run([sys.executable, "-c", LINT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5 kept, 0 broken" in proc.stdout
