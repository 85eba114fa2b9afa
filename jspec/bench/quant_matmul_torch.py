"""The torch side of ``quant-matmul``, in its own process (``quant-matmul --torch-only``, as ``matmul``'s
torch side) so that torch's CUDA libraries never share a process with XLA: the device copy bandwidth
and torch's own small-M quantized kernels at the same shapes and rows:

* ``torch_bf16``: ``F.linear`` (cuBLAS), weight ``[N, K]``;
* ``torch_int8``: ``torch._weight_int8pack_mm`` (int8 weight-only, per-channel scales);
* ``torch_int4_g128``: ``torch._weight_int4pack_mm`` (tinygemm, int4 with a scale and zero a group of
  128, after ``torch._convert_weight_to_int4pack``): the kernel behind torchao's int4 weight-only;
* ``torch_fp8``: ``torch._scaled_mm`` (cuBLASLt fp8 x fp8, row-wise scales): W8A8, x already in fp8
  (torch has no fp8 weight-only kernel; the activation's cast is not timed).

Each call is timed alone on the GPU (CUDA events) right after a read of a buffer larger than the L2
cache, so its weight comes from memory as the JAX side's does; the median of ``--repeats``. An op
this torch lacks or refuses at a shape gives a row with its error instead.
"""

from __future__ import annotations

import json


def run_torch(args, shapes, ms):
    """Writes ``{torch_version, device, copy, rows}`` to ``--torch-json``. ``shapes``: ``[(k, n, transposed)]``
    (torch's weights are ``[N, K]`` either way)."""
    import torch
    import torch.nn.functional as F

    from jspec.bench.roofline import torch_copy_timing
    from jspec.bench.timing import Timing

    dev = torch.device("cuda")
    copy = torch_copy_timing(1 << 30, repeats=20)
    res = {"torch_version": torch.__version__, "device": torch.cuda.get_device_name(0),
           "copy": {"method": "torch_copy", "bytes": 1 << 30, "tb_s": 2 * (1 << 30) / copy.median_s / 1e12,
                    "timings": {"torch_copy": copy.as_dict()}}, "rows": []}
    flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def gpu_time(op) -> Timing:
        for _ in range(3):
            op()
        samples = []
        for _ in range(args.repeats):
            flush_buffer.sum(dtype=torch.int32)  # evict the weight from L2 (reads 256 MiB, writes nothing much)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return Timing.of(samples)

    for k, n, transposed in shapes:
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k**0.5
        ops = {}  # name -> (make(x) -> thunk, weight bytes)
        ops["torch_bf16"] = (lambda x: (lambda: F.linear(x, w)), w.numel() * 2)
        try:
            ops.update(_int8(torch, w))
            ops.update(_int4(torch, w, group=128))
            ops.update(_fp8(torch, w))
        except Exception as e:  # noqa: BLE001 (a torch without these ops: the rows say so)
            res["rows"].append(dict(measure="torch_error", shape=f"{k}x{n}", error=repr(e)[:500]))
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            for name, (make, nbytes) in ops.items():
                row = dict(measure="torch", op=name, shape=f"{k}x{n}{'t' if transposed else ''}", k=k, n=n, m=m,
                           weight_bytes=nbytes)
                try:
                    timing = gpu_time(make(x))
                    row.update(gpu_us=timing.median_s * 1e6, tb_s=nbytes / timing.median_s / 1e12,
                               timings={"gpu": timing.as_dict("us")})
                except Exception as e:  # noqa: BLE001 (e.g. a shape the op refuses)
                    row["error"] = repr(e)[:500]
                res["rows"].append(row)
        del w, ops
        torch.cuda.empty_cache()
    with open(args.torch_json, "w") as f:
        json.dump(res, f)


def _int8(torch, w):
    scales = (w.abs().amax(dim=1).float() / 127).clamp(min=1e-8)
    q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    s = scales.to(torch.bfloat16)
    return {"torch_int8": (lambda x: (lambda: torch._weight_int8pack_mm(x, q, s)), q.numel() + s.numel() * 2)}


def _int4(torch, w, *, group):
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    low, high = g.amin(dim=2), g.amax(dim=2)
    scales = ((high - low) / 15).clamp(min=1e-8)
    codes = torch.round((g - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()  # [N, K / 2], tinygemm's nibble order
    weight = torch._convert_weight_to_int4pack(packed, 8)
    # tinygemm's zero is the value of the middle code 8: w = (c - 8) * scale + zero
    zeros = low + 8 * scales
    scales_and_zeros = torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
    nbytes = packed.numel() + scales_and_zeros.numel() * 2
    return {f"torch_int4_g{group}": (lambda x: (lambda: torch._weight_int4pack_mm(x, weight, group, scales_and_zeros)),
                                     nbytes)}


def _fp8(torch, w):
    fp8 = torch.float8_e4m3fn
    scale_w = (w.abs().amax(dim=1, keepdim=True).float() / 448).clamp(min=1e-12)  # [N, 1]
    q = (w.float() / scale_w).to(fp8)  # [N, K]

    def make(x):
        scale_x = (x.abs().amax(dim=1, keepdim=True).float() / 448).clamp(min=1e-12)  # [M, 1]
        xq = (x.float() / scale_x).to(fp8)
        return lambda: torch._scaled_mm(xq, q.t(), scale_a=scale_x, scale_b=scale_w.t(), out_dtype=torch.bfloat16)

    return {"torch_fp8": (make, q.numel() + scale_w.numel() * 4)}
