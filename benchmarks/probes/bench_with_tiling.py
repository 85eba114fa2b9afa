"""``python -m jspec.bench`` with a variant of the flash-decoding tiling rule
(``pallas_kernels.decode_tiling``), for before/after runs on one machine::

    PYTHONPATH=. python benchmarks/probes/bench_with_tiling.py VARIANT decode --targets smollm2-135m ...

Variants: ``before-one-wave`` (the rule before its one-wave case, ``_one_wave``),
``merge-in-kernel`` (every split call merges in the kernel, no combine launch),
``combine-kernel`` (split calls of more than two splits merge in a second kernel).
"""

import runpy
import sys

from pallas_kernels import decode_tiling

VARIANTS = {
    "before-one-wave": lambda: setattr(decode_tiling, "_ONE_WAVE_PROGRAMS", 0),
    "merge-in-kernel": lambda: setattr(decode_tiling, "_merge_in_kernel", lambda k_splits, **_: True),
    "combine-kernel": lambda: setattr(decode_tiling, "_merge_in_kernel", lambda k_splits, **_: k_splits <= 2),
}

VARIANTS[sys.argv.pop(1)]()
runpy.run_module("jspec.bench", run_name="__main__")
