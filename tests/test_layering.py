"""The layering the folders tell (DESIGN.md), enforced with import-linter's contracts in
pyproject.toml: kernels import nothing from jspec; the library in layers (models never import
drafters, engine or the benchmark lab; the core never imports the lab); configs import no
kernels; the model families are independent of each other; no import cycle anywhere (imports
inside functions included)."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exit_code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert exit_code == 0, report
    assert "5 kept, 0 broken" in report
