"""Stored tensors -> device parameters in one pass per tensor.

Checkpoints store a linear layer as ``[out, in]`` (PyTorch, GGUF); jspec keeps ``[in, out]``, with
projections that read the same input fused along ``out`` (q|k|v, gate|up). Each parameter is
written once, transposed and cast, into a fresh 64-byte-aligned host buffer that
``jax.device_put`` then adopts without a copy on the CPU (one host-to-device transfer on an
accelerator). Sources are read in row blocks, so a block is read (or dequantized) into cache
and written out while still there, and blocks run in parallel threads (numpy releases the GIL
inside each copy, cast and dequantizing step).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

# Rows per block: a transposed block writes this many contiguous elements per output row, and
# a block of a wide tensor still fits in cache; blocks copied as they are can be larger.
_TRANSPOSED_BLOCK_ROWS = 64
_BLOCK_ELEMENTS = 1 << 18
_ALIGN = 64  # what XLA's CPU client needs to adopt a host buffer without copying it
_pool: ThreadPoolExecutor | None = None


@dataclasses.dataclass(frozen=True)
class RowSource:
    """A stored tensor of ``shape`` (``[out, in]`` for a matrix) that ``read(lo, hi)`` returns in
    row blocks ``[hi - lo, *shape[1:]]``, any float dtype; blocks start and end at multiples of
    ``row_multiple`` (e.g. a head's rows, when the stored row order is permuted within heads)."""

    shape: tuple[int, ...]
    read: Callable[[int, int], np.ndarray]
    row_multiple: int = 1


def array_source(x: np.ndarray) -> RowSource:
    """A ``RowSource`` over an array already in memory."""
    return RowSource(tuple(x.shape), lambda lo, hi: x[lo:hi])


def aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 8)), thread_name_prefix="jspec-load")
    return _pool


def _blocks(source: RowSource, transpose: bool) -> list[tuple[int, int]]:
    rows, step = source.shape[0], source.row_multiple
    block = _TRANSPOSED_BLOCK_ROWS if transpose else _BLOCK_ELEMENTS // max(1, int(np.prod(source.shape[1:])))
    block = max(step, block // step * step)
    return [(lo, min(lo + block, rows)) for lo in range(0, rows, block)]


def assemble(sources: Sequence[RowSource], *, transpose: bool, dtype) -> jax.Array:
    """The sources as one device array of ``dtype``, concatenated along the last axis after
    transposing each ``[out, in]`` to ``[in, out]`` if asked (vectors are never transposed).

    Shapes: ``[in, sum(out)]`` with ``transpose``, else ``[*shape[:-1], sum(shape[-1])]``.
    """
    first = sources[0].shape
    transpose = transpose and len(first) == 2
    lead = first[1:] if transpose else first[:-1]
    widths = [s.shape[0] if transpose else s.shape[-1] for s in sources]
    out = aligned_empty((*lead, sum(widths)), dtype)
    offsets = np.cumsum([0, *widths])

    def write(job):
        source, offset, lo, hi = job
        block = source.read(lo, hi)
        if transpose:  # rows lo..hi of [out, in] are columns of [in, out]
            out[:, offset + lo : offset + hi] = block.T
        elif out.ndim == 1:
            out[offset + lo : offset + hi] = block
        else:
            out[lo:hi, ..., offset : offset + source.shape[-1]] = block

    jobs = [(s, int(offsets[i]), lo, hi) for i, s in enumerate(sources) for lo, hi in _blocks(s, transpose)]
    if len(jobs) == 1:
        write(jobs[0])
    else:
        for _ in _threads().map(write, jobs):  # re-raises a worker's exception here
            pass
    return jax.device_put(out)


Getter = Callable[..., jax.Array]


def getter(source: Callable[[str], RowSource], dtype) -> Getter:
    """``get(name_or_names, transpose=False)``: the named tensor as a device array of ``dtype``
    (``[in, out]`` with ``transpose``); a tuple of names gives them fused along the last axis,
    written straight into one buffer."""
    dtype = np.dtype(dtype)

    def get(names, transpose=False):
        names = (names,) if isinstance(names, str) else tuple(names)
        return assemble([source(n) for n in names], transpose=transpose, dtype=dtype)

    return get
