"""Shared by the persistent-launch probes (``semaphore_hop.py``, ``megakernel_phase.py``): a chain's
cost per link from GPU times at several lengths, and one process per cell, since a persistent kernel
whose wait is never satisfied hangs the GPU instead of failing."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import jax
import numpy as np

from jspec.bench.timing import interleaved_gpu_times


def per_link_us(calls: dict, *, repeats: int = 9) -> dict:
    """``calls``: ``"<n> phases"`` -> a chain of n links. Median GPU us of each, interleaved, and the
    slope over n (``us_per_link``): what one more link costs."""
    times = interleaved_gpu_times(calls, repeats=repeats)
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    found = {f"{name} us": round(v, 2) for name, v in us.items()}
    links = [int(name.split()[0]) for name in us]
    if len(links) > 1:
        found["us_per_link"] = round(float(np.polyfit(links, list(us.values()), 1)[0]), 3)
    return found


def cells_in_children(script: str, keys, *, timeout_s: float) -> dict:
    """Run ``script`` once per key with ``PROBE_CELL=key`` (the child prints its cell as JSON last)."""
    cells = {}
    for key in keys:
        try:
            run = subprocess.run([sys.executable, script], env={**os.environ, "PROBE_CELL": str(key)},
                                 capture_output=True, text=True, timeout=timeout_s)
            cells[key] = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else run.stderr[-500:]
        except subprocess.TimeoutExpired:
            cells[key] = f"timed out after {timeout_s:g} s"
        print(key, cells[key], flush=True)
    return cells


def probe_main(script: str, keys, cell, *, lower_for_cuda, out_name: str, timeout_s: float) -> None:
    """A persistent-launch probe's entry: without a GPU ``lower_for_cuda()``; in a child the cell of
    ``$PROBE_CELL`` (``cell(key as str)``) as JSON; else every key's cell in a child of its own, written
    to ``$OUT/out_name``."""
    if jax.default_backend() != "gpu":
        return lower_for_cuda()
    if "PROBE_CELL" in os.environ:
        print(json.dumps(cell(os.environ["PROBE_CELL"])))
        return
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "cells": cells_in_children(script, keys, timeout_s=timeout_s)}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), out_name), "w") as f:
        json.dump(result, f, indent=1)
