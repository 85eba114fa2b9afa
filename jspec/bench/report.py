"""The one result schema of every ``python -m jspec.bench`` command, and its plot helper.

A result is::

    {"schema": "jspec.bench/1",
     "command": "spec" | "kernels check" | ...,       # subcommand [action]
     "argv": [...],                                   # the command line
     "environment": {device, platform, jax_version, python, dtype, seed, weights, date, xla_flags,
                     loop_compiler_options, tokamax_version, compilation_cache},
     "rows": [{"measure": "<name>", ...fields...}, ...],
     ...}                                             # a few extras: copy_bandwidth, notes

Every timed figure of a row comes with its spread: the row's ``timings`` maps a name to
``{median_<unit>, p10_<unit>, p90_<unit>, repeats}`` (:meth:`jspec.bench.timing.Timing.as_dict`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from jspec.bench import peers
from jspec.compile_options import LOOP_COMPILER_OPTIONS

SCHEMA = "jspec.bench/1"
ENVIRONMENT_KEYS = ("device", "platform", "jax_version", "python", "dtype", "seed", "weights", "date", "xla_flags")
EXTRAS = ("copy_bandwidth", "notes")
_UNITS = ("ms", "us", "s")


def environment(dtype, seed: int | None, *, weights: str = "random (generated on the device)") -> dict:
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax_version": jax.__version__,
        "python": platform.python_version(),
        "dtype": None if dtype is None else jnp.dtype(dtype).name,
        "seed": seed,
        "weights": weights,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # What jspec's on-device loops are compiled with, whatever XLA_FLAGS says.
        "loop_compiler_options": dict(LOOP_COMPILER_OPTIONS),
        "tokamax_version": peers.version(),  # the peer kernel library, where installed
        "compilation_cache": jax.config.jax_compilation_cache_dir,  # --compile-cache (None: every program compiled)
    }


def result(command: str, argv: list[str], env: dict, rows: list[dict], **extras) -> dict:
    """A result of the schema (validated); ``argv``: the arguments after ``python -m jspec.bench``;
    ``extras`` only from :data:`EXTRAS`."""
    out = {"schema": SCHEMA, "command": command, "argv": list(argv),
           "environment": env, "rows": rows}
    out.update({name: value for name, value in extras.items() if value is not None})
    return validate(out)


def _check_spread(where: str, spread) -> None:
    if not isinstance(spread, dict):
        raise ValueError(f"{where}: a timing is a dict, got {spread!r}")
    unit = next((u for u in _UNITS if f"median_{u}" in spread), None)
    if unit is None or not {f"p10_{unit}", f"p90_{unit}", "repeats"} <= set(spread):
        raise ValueError(f"{where}: a timing needs median_<unit>, p10_<unit>, p90_<unit> and repeats, "
                         f"got {sorted(spread)}")
    if not spread[f"p10_{unit}"] <= spread[f"median_{unit}"] <= spread[f"p90_{unit}"] or spread["repeats"] < 1:
        raise ValueError(f"{where}: p10 <= median <= p90 and repeats >= 1 do not hold: {spread}")


def validate(data: dict) -> dict:
    """``data`` itself if it follows the schema; otherwise ``ValueError`` naming what does not."""
    required = {"schema", "command", "argv", "environment", "rows"}
    if not isinstance(data, dict) or not required <= set(data):
        raise ValueError(f"a result needs the keys {sorted(required)}")
    if data["schema"] != SCHEMA:
        raise ValueError(f"schema {data['schema']!r} != {SCHEMA!r}")
    unknown = set(data) - required - set(EXTRAS)
    if unknown:
        raise ValueError(f"unknown top-level keys {sorted(unknown)} (extras allowed: {EXTRAS})")
    if not isinstance(data["command"], str) or not all(isinstance(a, str) for a in data["argv"]):
        raise ValueError("command is a string and argv a list of strings")
    missing = set(ENVIRONMENT_KEYS) - set(data["environment"])
    if missing:
        raise ValueError(f"environment lacks {sorted(missing)}")
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict) or not isinstance(row.get("measure"), str):
            raise ValueError(f"row {i} has no 'measure' name: {row!r}"[:300])
        for name, spread in (row.get("timings") or {}).items():
            if spread is not None:
                _check_spread(f"row {i} ({row['measure']}) timing {name!r}", spread)
        if any(key.startswith("median_") for key in row):
            _check_spread(f"row {i} ({row['measure']})", row)
    return data


def write(path, data: dict) -> Path:
    """Validate and write a result as JSON (the parent folder is made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(validate(data), indent=1, default=float))
    return path


def read(path) -> dict:
    return json.loads(Path(path).read_text())


def rows(data: dict, measure: str) -> list[dict]:
    return [row for row in data["rows"] if row["measure"] == measure]


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
