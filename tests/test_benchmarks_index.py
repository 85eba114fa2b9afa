"""benchmarks/ is an index of today's figures: its README names every file the folder holds, every
file it names exists, and it stays short enough to read."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
README = BENCHMARKS / "README.md"
MAX_README_LINES = 300
MAX_FILES = 80

# An inline code span naming a result or probe: `decode_h200.json`, `spec_x.json/png` (both files),
# `probes/semaphore_hop.py`, `tokamax_peers_h100/skinny_matmul.json`.
NAMED_FILE = re.compile(r"`([\w./-]+\.(?:json|png|py))(/png)?`")


def _held_files() -> set[str]:
    return {p.relative_to(BENCHMARKS).as_posix() for p in BENCHMARKS.rglob("*")
            if p.is_file() and p != README and "__pycache__" not in p.parts}


def _named_files() -> set[str]:
    named = set()
    for name, both in NAMED_FILE.findall(README.read_text()):
        named.add(name)
        if both:
            named.add(name.removesuffix(".json") + ".png")
    return named


def test_every_file_in_benchmarks_is_named_in_its_readme():
    unnamed = sorted(_held_files() - _named_files())
    assert not unnamed, f"files in benchmarks/ that benchmarks/README.md names nowhere: {unnamed}"


def test_every_result_the_readme_names_exists():
    # Names with a folder are resolved from the repository root too (`jspec/bench/presets.py`);
    # a bare `config.json` is the checkpoint's, not a result.
    missing = sorted(name for name in _named_files() - {"config.json"}
                     if not (BENCHMARKS / name).is_file() and not (ROOT / name).is_file())
    assert not missing, f"benchmarks/README.md names files that do not exist: {missing}"


def test_the_index_stays_an_index():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"benchmarks/README.md has {lines} lines (at most {MAX_README_LINES})"
    held = len(_held_files())
    assert held <= MAX_FILES, f"benchmarks/ holds {held} files (at most {MAX_FILES})"


def test_the_readme_is_organised_by_measure_not_by_date():
    dated = [line for line in README.read_text().splitlines()
             if line.startswith("#") and re.search(r"\b20\d\d-\d\d-\d\d\b|\bsession\b|\bruns of\b", line, re.I)]
    assert not dated, f"dated or diary headings in benchmarks/README.md: {dated}"
