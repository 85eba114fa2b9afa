"""The Gemma 4 assistant's propose (Frozen-KV MTP, the E4B-shaped assistant of ``bench frozen-kv``: hidden
256, 4 layers, 2048 centroids) inside an on-device loop of proposes
(``jspec.bench.rounds.time_proposes_in_loop``: per propose, the loop's own iteration and their
difference), with its draft steps in a rolled ``lax.scan`` (the library's) or, with ``UNROLLED=1``,
unrolled (the drafter module alone sees a ``jax.lax.scan`` that forces ``unroll=True``; ``UNROLLED=2``:
two steps a loop iteration; the twelfth session's files of 2026-11-28 were made when the library
unrolled and ``ROLLED=1`` forced ``unroll=1``). Batch 1, context 512, bf16 random weights; the target
keeps ``TARGET_LAYERS`` of its layers (default 6: five sliding and one full, none KV-shared; the
assistant reads only the last of each type and the embedding table). ``TIMELINE=1``: every kernel of a
loop of two proposes at each k, in launch order (own GPU time). ``CHECK=1``: one propose's drafts
(k = 6) with the drafter on ``auto`` and on ``xla``. Run from the tree::

    PYTHONPATH=. OUT=. TAG=rolled python benchmarks/probes/assistant_propose_in_loop.py
    PYTHONPATH=. OUT=. TAG=unrolled UNROLLED=1 python benchmarks/probes/assistant_propose_in_loop.py
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

import jspec
from jspec.bench import frozen_kv
from jspec.bench.presets import PRESETS, confident
from jspec.bench.rounds import spec_state, stage_calls, time_proposes_in_loop
from jspec.bench.timing import timeline
from jspec.drafters.frozen_kv_mtp import drafter as drafter_module
from scan_unroll import force_scan_unroll

CONTEXT, CAPACITY, KS = 512, 1024, (4, 6)


def main():
    out, tag = os.environ.get("OUT", "."), os.environ.get("TAG", "tree")
    name = os.environ.get("TARGET", "gemma-4-e4b")
    layers = int(os.environ.get("TARGET_LAYERS", 6))
    preset = PRESETS[name]
    config = dataclasses.replace(preset, num_layers=layers, layer_types=preset.layer_types[:layers],
                                 num_kv_shared_layers=0)
    if os.environ.get("UNROLLED"):  # 1: every step; n > 1: n steps a loop iteration
        force_scan_unroll(drafter_module, True if os.environ["UNROLLED"] == "1" else int(os.environ["UNROLLED"]))
    target = confident(jax.jit(jspec.init_params, static_argnums=(0, 2))(config, jax.random.key(0), jnp.bfloat16), 0)
    drafter = frozen_kv.make_drafter(target, name, path=None, dtype=jnp.bfloat16, seed=0, impl="auto")
    state = spec_state(target, drafter, 1, CONTEXT, CAPACITY, "auto")
    result = dict(tag=tag, target=name, target_layers=layers, context=CONTEXT, unrolled=os.environ.get("UNROLLED"),
                  device=str(jax.devices()[0]), runs={})
    if os.environ.get("CHECK"):  # the drafts of one propose on the kernels == on XLA's ops
        on_xla = frozen_kv.make_drafter(target, name, path=None, dtype=jnp.bfloat16, seed=0, impl="xla")
        drafts = {impl: stage_calls(target, d, state, max(KS), impl=impl)[0]["propose"]().tolist()
                  for impl, d in (("auto", drafter), ("xla", on_xla))}
        result["drafts"] = drafts | dict(equal=drafts["auto"] == drafts["xla"])
        print(tag, "drafts", result["drafts"], flush=True)
    for k in KS:
        _, loops = stage_calls(target, drafter, state, k, impl="auto")
        runs = []
        for _ in range(2):
            seconds, _ = time_proposes_in_loop(loops, repeats=10)
            runs.append({key.removesuffix("_s") + "_ms": value * 1e3 for key, value in seconds.items()})
        result["runs"][f"k{k}"] = runs
        if os.environ.get("TIMELINE"):
            result[f"timeline_k{k}"] = timeline([lambda: loops["propose"](2)])
        print(tag, k, [round(r["propose_net_ms"], 4) for r in runs], flush=True)
    with open(f"{out}/assistant_propose_in_loop_{tag}.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
