"""The one timer family of the benchmarks.

Rule: warm up (compile + first runs), then time many samples and report the median and the
spread (:class:`Timing`); every timed region ends by synchronising on its outputs.

* :func:`time_fn` -- wall time of a thunk (JAX, or torch with ``sync=torch_sync``), optionally
  ``calls`` back-to-back calls per sample; :func:`time_steps` the same for a donated
  ``state -> state`` step; :func:`chained` makes one program of ``inner`` dependent calls
  (``Timing.per`` divides by the calls a sample covers).
* :func:`cuda_event_times` -- GPU time between two CUDA events (torch).
* :func:`gpu_kernel_times`, :func:`interleaved_gpu_times` -- each kernel's GPU time beyond the
  kernels before it (:func:`own_times`) from the profiler (CUPTI), optionally after an L2 flush;
  :func:`torch_kernel_seconds` each kernel's time from torch's profiler.
* :func:`compile_all` -- compile many lowered programs in parallel threads before timing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds: median and 10th / 90th percentiles over ``repeats`` samples."""

    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    calls_per_sample: int = 1

    @classmethod
    def of(cls, samples: Iterable[float], calls_per_sample: int = 1) -> Timing:
        samples = [float(s) for s in samples]
        q = np.quantile(samples, [0.1, 0.9])
        return cls(statistics.median(samples), float(q[0]), float(q[1]), len(samples), calls_per_sample)

    def per(self, n: float) -> Timing:
        """The same timing divided by ``n`` (calls or items covered by one sample)."""
        return dataclasses.replace(self, median_s=self.median_s / n, p10_s=self.p10_s / n, p90_s=self.p90_s / n)

    def as_dict(self, unit: str = "ms") -> dict:
        f = {"ms": 1e3, "us": 1e6, "s": 1.0}[unit]
        out = {f"median_{unit}": self.median_s * f, f"p10_{unit}": self.p10_s * f, f"p90_{unit}": self.p90_s * f,
               "repeats": self.repeats}
        if self.calls_per_sample > 1:
            out["calls_per_sample"] = self.calls_per_sample
        return out


def time_fn(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 10, calls: int = 1,
            sync: Callable[[object], object] = jax.block_until_ready) -> Timing:
    """Wall time per call of ``fn()``: each sample times ``calls`` back-to-back calls ending in
    one ``sync`` on the last output (``jax.block_until_ready``, or :func:`torch_sync`)."""
    for _ in range(warmup):
        sync(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        sync(out)
        samples.append((time.perf_counter() - start) / calls)
    return Timing.of(samples, calls)


def time_steps(step: Callable, state, *, warmup: int = 3, repeats: int = 10, calls: int = 1):
    """:func:`time_fn` of a donated ``state -> state`` step dispatched back to back, each call on
    the last one's output. Returns ``(Timing, final state)``."""
    last = [state]

    def advance():
        last[0] = step(last[0])
        return last[0]

    return time_fn(advance, warmup=warmup, repeats=repeats, calls=calls), last[0]


def chained(step: Callable, inner: int) -> Callable:
    """One jitted program of ``inner`` dependent calls ``carry = step(carry, *args)``: nothing is
    hoisted or fused across calls and host dispatch is amortised (time it with :func:`time_fn`
    and divide by ``inner`` with :meth:`Timing.per`)."""

    def run(carry, *args):
        for _ in range(inner):
            carry = step(carry, *args)
        return carry

    return jax.jit(run)


def torch_sync(_=None) -> None:
    import torch

    torch.cuda.synchronize()


def cuda_event_times(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10, calls: int = 1) -> Timing:
    """GPU time per call of ``fn`` (torch) between two CUDA events around ``calls`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return Timing.of(samples, calls)


def torch_kernel_seconds(fn: Callable[[], object]) -> float:
    """GPU seconds of the kernels one call of ``fn`` runs (torch's profiler, as
    :func:`gpu_kernel_times` in JAX), after one warm-up call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) * 1e-6


def compile_all(lowered: dict, threads: int = 8, *, keep_errors: bool = False) -> dict:
    """``{key: lowered.compile()}``, compiled in ``threads`` parallel threads (XLA releases the GIL).
    ``keep_errors``: a program that fails to compile maps to its exception instead of raising it."""
    def build(low):
        try:
            return low.compile()
        except Exception as e:  # noqa: BLE001
            if not keep_errors:
                raise
            return e

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        return dict(zip(lowered, pool.map(build, lowered.values())))


def own_times(events: list[tuple[int, str, int]]) -> list[tuple[str, float]]:
    """``(name, seconds)`` in start order from kernel events ``(start_ns, name, duration_ns)``: each
    kernel's time beyond the kernels before it, its end minus the later of its start and every
    earlier kernel's end. Under programmatic dependent launch (``pallas_kernels/pdl.py``) a kernel
    starts while the one before it still runs and waits for it at entry; its own duration would count
    that wait twice. The times sum to the time the GPU was busy."""
    times, frontier = [], 0
    for start, name, duration in sorted(events):
        end = start + duration
        times.append((name, max(0, end - max(start, frontier)) * 1e-9))
        frontier = max(frontier, end)
    return times


def traced_events(thunks: list[Callable[[], object]]) -> list[tuple[int, str, int]]:
    """``(start_ns, kernel name, duration_ns)`` of every GPU kernel the thunks run, from one profiler
    trace (CUPTI), as the profiler reports them: under programmatic dependent launch a kernel's
    duration includes its wait for the kernel before it (see :func:`own_times`)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for thunk in thunks:
                jax.block_until_ready(thunk())
        data = jax.profiler.ProfileData.from_file(str(next(Path(trace_dir).rglob("*.xplane.pb"))))
    kernels = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # "XLA Ops" / "XLA Modules" repeat the kernels
                continue
            kernels += [(event.start_ns, event.name, event.duration_ns) for event in line.events
                        if not event.name.startswith(("Memcpy", "Memset"))]
    return kernels


def _traced_kernels(thunks: list[Callable[[], object]]) -> list[tuple[str, float]]:
    """``(kernel name, seconds)`` of every GPU kernel the thunks run, in launch order, from one
    profiler trace: each kernel's time on the GPU (:func:`own_times`), without host dispatch or gaps."""
    return own_times(traced_events(thunks))


def _l2_flush(num_bytes: int) -> Callable[[], object]:
    """A thunk that reads ``num_bytes`` (and writes 1/256 of that): the L2 cache is left holding
    clean lines of its buffer only. A flush that wrote its buffer left the cache full of dirty
    lines, whose write-back the next timed call would pay for.
    A kernel of its own name (``jspec_l2_flush``): :func:`interleaved_gpu_times` splits a trace at it,
    and XLA's name for a plain reduction is any reduction's."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    from pallas_kernels.dispatch import interpret_mode

    rows, columns = 256, 1024  # 1 MiB a program, read 8 rows at a time
    programs = max(1, num_bytes // (rows * columns * 4))

    def kernel(x_ref, o_ref):
        def read(i, acc):
            return jnp.maximum(acc, x_ref[pl.ds(i * 8, 8), :] ^ jnp.uint32(0x5A5A5A5A))

        acc = lax.fori_loop(0, rows // 8, read, jnp.zeros((8, columns), jnp.uint32))
        o_ref[...] = jnp.max(acc, axis=0, keepdims=True)

    # A plain pallas_call, not pallas_kernels.pdl's: the call timed after the flush must not launch early.
    read_all = jax.jit(pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((programs, columns), jnp.uint32), grid=(programs,),
        in_specs=[pl.BlockSpec((rows, columns), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, columns), lambda i: (i, 0)),
        compiler_params=pl_triton.CompilerParams(num_warps=4), interpret=interpret_mode(), name="jspec_l2_flush"))
    buffer = jnp.zeros((programs * rows, columns), jnp.uint32)
    return lambda: read_all(buffer)


def gpu_kernel_times(fn: Callable[[], object], *, warmup: int = 2,
                     flush_l2_bytes: int = 0) -> list[tuple[str, float]]:
    """``(kernel name, seconds)`` of every GPU kernel that one call of ``fn()`` runs.

    The times come from the profiler (CUPTI): each kernel's time on the GPU beyond the kernels
    before it (:func:`own_times`), without host dispatch or the gaps between kernels; where kernels
    do not overlap, the durations torch's profiler and Nsight report, so a kernel can be compared
    with a peer's kernel regardless of how either framework launches it.
    ``flush_l2_bytes``: read a buffer that large (:func:`_l2_flush`) just before the traced call, so
    that inputs the warm-up left in the L2 cache are read from memory again (a cold call). Empty off
    a GPU.
    """
    if jax.default_backend() != "gpu":  # no GPU kernels to time: skip the warm-up and the trace
        return []
    for _ in range(warmup):
        jax.block_until_ready(fn())
    if flush_l2_bytes:
        jax.block_until_ready(_l2_flush(flush_l2_bytes)())
    return _traced_kernels([fn])


def gpu_seconds(fn: Callable[[], object], *, repeats: int, flush_l2_bytes: int = 256 << 20) -> Timing | None:
    """GPU time of all the kernels of one cold call (after an L2 flush), ``repeats`` calls; None
    off a GPU. The first call also warms ``fn`` up (compile)."""
    samples = [sum(t for _, t in gpu_kernel_times(fn, warmup=2 if i == 0 else 0, flush_l2_bytes=flush_l2_bytes))
               for i in range(repeats)]
    return Timing.of(samples) if any(samples) else None


def interleaved_gpu_times(calls: dict[str, Callable[[], object]], *, repeats: int = 5,
                          flush_l2_bytes: int = 256 << 20) -> dict[str, list[float]]:
    """GPU seconds per call (all its kernels) of each named thunk, ``repeats`` cold calls each.

    The calls are interleaved (a, b, c, a, b, c, ...) inside one profiler trace, each after its own
    L2 flush, so that slow drifts of the GPU (clocks, temperature) touch every candidate alike.
    The flush kernels, recognised by name from a trace of the flush alone, separate the calls.
    Empty lists off a GPU.
    """
    if jax.default_backend() != "gpu":
        return {name: [] for name in calls}
    flush = _l2_flush(flush_l2_bytes)
    for thunk in (flush, *calls.values()):  # compile and warm up
        jax.block_until_ready(thunk())
    flush_names = {name for name, _ in _traced_kernels([flush])}
    order = [name for _ in range(repeats) for name in calls]
    kernels = _traced_kernels([thunk for name in order for thunk in (flush, calls[name])])
    if sum(name in flush_names for name, _ in kernels) != len(order):
        raise RuntimeError(f"the L2 flush kernel {sorted(flush_names)} is not a unique call separator")
    times = {name: [] for name in calls}
    call = -1
    for name, seconds in kernels:
        if name in flush_names:
            call += 1
            times[order[call]].append(0.0)
        else:
            times[order[call]][-1] += seconds
    return times
