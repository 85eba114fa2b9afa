"""The best a whole-step dataflow megakernel could do at batch 1, from a hop's measured cost (CPU).

A Llama-family decode step is a chain of dependent phases, each needing all of the phase before:
per layer RMSNorm + q/k/v, attention (RoPE and the cache write folded in), o + residual, RMSNorm +
gate/up, down + residual; then the final norm + LM head, the argmax across the programs that hold
the logits, and the next token's embedding row. A perfect megakernel streams each phase's weights
while it waits (they never depend on the phase before), so a phase costs the larger of its bytes over
the bandwidth and one hop (``--hop-us``: signal, wait, load the row, store: ``semaphore_hop.py``)
plus its own work on the critical path (``--work-us``: the product from shared memory, the norm's
sum; ``megakernel_phase.py``). The bound is the sum over the step's phases; the roofline fraction it
allows is the step's bytes over the bandwidth, over that sum. Shapes from the presets (abstract
weights: nothing is allocated)::

    PYTHONPATH=. python benchmarks/probes/megakernel_bound.py                    # H200 hop, 4.2 TB/s
    PYTHONPATH=. python benchmarks/probes/megakernel_bound.py --bandwidth-tb-s 2.95 --hop-us 1.45
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jspec.bench.presets import PRESETS, abstract_target


def _nbytes(x) -> int:
    return int(x.size * x.dtype.itemsize)


def phase_bytes(preset: str, context: int) -> list[tuple[str, int]]:
    """``(phase, bytes it must read)`` of one decode step, batch 1, in dependency order."""
    config = PRESETS[preset]
    model = abstract_target(preset, jnp.bfloat16)
    kv = 2 * config.num_kv_heads * context * config.head_dim * 2  # K and V rows of one layer, bf16
    phases = []
    for layer in model.layers:
        phases += [("norm + qkv", _nbytes(layer.qkv)), ("attention", kv), ("o + residual", _nbytes(layer.o)),
                   ("norm + gate/up", _nbytes(layer.gate_up)), ("down + residual", _nbytes(layer.down))]
    head = model.lm_head if model.lm_head is not None else model.embed  # tied: the embedding table
    phases += [("norm + LM head", _nbytes(head)), ("argmax", 0), ("embedding row", config.hidden_size * 2)]
    return phases


def bound(preset: str, *, context: int, hop_us: float, work_us: float, bandwidth: float) -> dict:
    phases = phase_bytes(preset, context)
    total_bytes = sum(b for _, b in phases)
    step_s = sum(max(hop_us * 1e-6 + work_us * 1e-6, b / bandwidth) for _, b in phases)
    roofline_s = total_bytes / bandwidth
    return {"preset": preset, "phases": len(phases), "step_ms": step_s * 1e3, "roofline_ms": roofline_s * 1e3,
            "best_roofline_fraction": roofline_s / step_s,
            "hop_bound_phases": sum(b / bandwidth < (hop_us + work_us) * 1e-6 for _, b in phases)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", default=["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"])
    parser.add_argument("--context", type=int, default=544, help="cache rows (544: the middle of a 64-step loop)")
    parser.add_argument("--hop-us", type=float, nargs="+", default=[1.19, 1.45],
                        help="a hop's cost (H200, Mosaic GPU: 1.19 at 8 programs, 1.45 at 66-132)")
    parser.add_argument("--work-us", type=float, nargs="+", default=[0.3, 0.5])
    parser.add_argument("--bandwidth-tb-s", type=float, default=4.2, help="copy bandwidth (H200 ~4.2, H100 ~2.95)")
    args = parser.parse_args()
    print(f"{'preset':<14} {'hop':>5} {'work':>5} {'phases':>6} {'hop-bound':>9} {'step ms':>8} {'roofline ms':>11} "
          f"{'best fraction':>13}")
    for preset in args.presets:
        for hop in args.hop_us:
            for work in args.work_us:
                b = bound(preset, context=args.context, hop_us=hop, work_us=work, bandwidth=args.bandwidth_tb_s * 1e12)
                print(f"{preset:<14} {hop:>5.2f} {work:>5.2f} {b['phases']:>6} {b['hop_bound_phases']:>9} "
                      f"{b['step_ms']:>8.3f} {b['roofline_ms']:>11.3f} {b['best_roofline_fraction']:>13.3f}")


if __name__ == "__main__":
    main()
