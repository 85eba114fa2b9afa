"""The torch side of ``matmul``, run in its own process (``matmul --torch-only``) so that torch's
CUDA libraries never share a process with XLA: the device copy bandwidth (``copy_``) and
``F.linear`` (cuBLAS, weights ``[N, K]``) / ``torch.matmul`` (weights ``[K, N]``) for every
shape and M, captured in a CUDA graph so launch overhead is amortised, plus the kernels' GPU
time from torch's profiler."""

from __future__ import annotations

import json
import math


def parse_shapes(s):
    return [tuple(int(v) for v in p.split("x")) for p in s.split(",") if p]


def parse_ints(s):
    return [int(v) for v in s.split(",") if v]


def n_weights(k, n, target_bytes):
    """Distinct weights per timed program: enough bytes to exceed the L2 cache."""
    return max(2, math.ceil(target_bytes / (k * n * 2)))


def plan(args):
    """``[(k, n, [m, ...], extra), ...]``: --shapes at --ms, then --extra-shapes at --extra-ms."""
    return ([(k, n, parse_ints(args.ms), False) for k, n in parse_shapes(args.shapes)]
            + [(k, n, parse_ints(args.extra_ms), True) for k, n in parse_shapes(args.extra_shapes)])


def run_torch(args):
    """Writes ``{torch_version, device, copy, rows}`` to ``--torch-json``."""
    import torch
    import torch.nn.functional as F

    from jspec.bench.roofline import torch_copy_timing
    from jspec.bench.timing import cuda_event_times, torch_kernel_seconds

    dev = torch.device("cuda")
    copy = torch_copy_timing(1 << 30, repeats=20)
    res = {"torch_version": torch.__version__, "device": torch.cuda.get_device_name(0),
           "copy": {"method": "torch_copy", "bytes": 1 << 30, "tb_s": 2 * (1 << 30) / copy.median_s / 1e12,
                    "timings": {"torch_copy": copy.as_dict()}}, "rows": []}

    def time_graph(fn_list):
        """Seconds per matmul of ``fn_list`` replayed as one CUDA graph, ``--calls`` replays a sample."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                for f in fn_list:
                    f()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [f() for f in fn_list]
        timing = cuda_event_times(g.replay, warmup=3, repeats=args.repeats, calls=args.calls).per(len(fn_list))
        del outs, g
        return timing

    for k, n, mlist, extra in plan(args):
        nw = n_weights(k, n, args.target_bytes)
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(nw)]
        wkn = [torch.randn(k, n, dtype=torch.bfloat16, device=dev) for _ in range(nw)]
        for m in mlist:
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device=dev) for _ in range(nw)]
            for op, fns in (("linear", [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)]),
                            ("matmul_kn", [lambda x=x, w=w: torch.matmul(x, w) for x, w in zip(xs, wkn)])):
                timing = time_graph(fns)
                device_s = torch_kernel_seconds(lambda fns=fns: [f() for f in fns]) / len(fns)
                res["rows"].append(dict(measure="torch", op=op, shape=f"{k}x{n}", k=k, n=n, m=m, extra=extra,
                                        tb_s=k * n * 2 / timing.median_s / 1e12,
                                        device_tb_s=k * n * 2 / device_s / 1e12,
                                        timings={"graph": timing.as_dict("us")}))
        del ws, wkn
        torch.cuda.empty_cache()
    with open(args.torch_json, "w") as f:
        json.dump(res, f)
