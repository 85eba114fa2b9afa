"""``python -m jspec.bench`` with a variant of the flash-decoding tiling rule
(``pallas_kernels.decode_tiling``), for before/after runs on one machine::

    PYTHONPATH=. python benchmarks/probes/bench_with_tiling.py VARIANT decode --targets smollm2-135m ...

Variants: ``before-one-wave`` (the rule before its one-wave case, ``_one_wave``),
``merge-in-kernel`` (every split call merges in the kernel, no combine launch),
``combine-kernel`` (split calls of more than two splits merge in a second kernel), ``one-wave-given``
(where the rule reads one block per program, the knobs of the JSON in ``$ONE_WAVE_TILING`` instead,
e.g. ``{"k_splits": 1, "block_k": 128, "num_stages": 2}``; two splits merge in the kernel by the rule).
"""

import json
import os
import runpy
import sys

from pallas_kernels import decode_tiling


def _one_wave_given():
    rule, knobs = decode_tiling._default_config, json.loads(os.environ["ONE_WAVE_TILING"])

    def default_config(batch, num_kv_heads, m_blocks, rows, head_dim, block_m, **kw):
        cfg = rule(batch, num_kv_heads, m_blocks, rows, head_dim, block_m, **kw)
        if decode_tiling._one_wave(batch * num_kv_heads * m_blocks, rows, block_m, head_dim):
            cfg = {**cfg, **knobs}
        return cfg

    decode_tiling._default_config = default_config


VARIANTS = {
    "before-one-wave": lambda: setattr(decode_tiling, "_ONE_WAVE_PROGRAMS", 0),
    "merge-in-kernel": lambda: setattr(decode_tiling, "_merge_in_kernel", lambda k_splits, **_: True),
    "combine-kernel": lambda: setattr(decode_tiling, "_merge_in_kernel", lambda k_splits, **_: k_splits <= 2),
    "one-wave-given": _one_wave_given,
}

VARIANTS[sys.argv.pop(1)]()
runpy.run_module("jspec.bench", run_name="__main__")
