"""What a decode step runs between its Pallas kernels, layer by layer, from the jaxpr alone (CPU).

The GPU's dispatch rules are switched on (``on_gpu`` patched to True, no interpreter), the step
of a preset (batch 1, one new token, a 640-row cache, ``forward`` with ``--impl``) is traced with
abstract bf16 weights, and each stretch of XLA ops between two ``pallas_call``s is printed with
the library lines that made it. Each stretch is one or more XLA kernels on the GPU (matmuls,
reductions and scatters start kernels of their own): the map of what is left to fuse.
``hlo_kernels.py`` names the kernels of a GPU profile instead. No GPU needed::

    PYTHONPATH=. python benchmarks/probes/layer_ops.py gemma-4-e4b --layers 1 2
"""

from __future__ import annotations

import argparse
import collections
import importlib

import jax
import jax.numpy as jnp
from jax._src import source_info_util

_KERNEL_MODULES = ("_dispatch", "add_rms_norm", "decode_attention", "gather_rows", "rope_write", "skinny_matmul")
_CALLS = ("pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint", "jit")
_QUIET = ("broadcast_in_dim", "reshape", "squeeze", "convert_element_type", "expand_dims", "stop_gradient")
# ops that start an XLA kernel of their own rather than fusing into their neighbours
_KERNEL_STARTS = ("dot_general", "scatter", "reduce_sum", "reduce_max", "dynamic_update_slice", "sort", "argmax")


def _as_gpu():
    """The dispatchers' GPU rules on this machine (traced only: nothing runs)."""
    for name in _KERNEL_MODULES:
        module = importlib.import_module(f"pallas_kernels.{name}")
        if hasattr(module, "on_gpu"):
            module.on_gpu = lambda: True
        if hasattr(module, "interpret_mode"):
            module.interpret_mode = lambda: False


def _events(jaxpr):
    """``("kernel", name)`` or ``("op", primitive, shape, "file:line")`` in program order, calls inlined."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            yield "kernel", eqn.params.get("name") or "pallas_call"
            continue
        inner = next((v for k, v in eqn.params.items() if k in ("jaxpr", "call_jaxpr", "fun_jaxpr")), None)
        if name in _CALLS and inner is not None:
            yield from _events(getattr(inner, "jaxpr", inner))
            continue
        frame = source_info_util.user_frame(eqn.source_info.traceback)
        where = f"{frame.file_name.split('/work/main/')[-1]}:{frame.start_line}" if frame else "?"
        shape = tuple(getattr(eqn.outvars[0].aval, "shape", ())) if eqn.outvars else ()
        yield "op", name, shape, where


def stretches(events):
    """Kernels and the XLA stretches between them: ``("kernel", name)`` / ``("xla", ops)``."""
    out, ops = [], []
    for event in events:
        if event[0] == "kernel":
            if ops:
                out.append(("xla", ops))
                ops = []
            out.append(event)
        elif event[1] not in _QUIET:
            ops.append(event[1:])
    if ops:
        out.append(("xla", ops))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a preset of jspec.bench.presets")
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--context", type=int, default=640, help="cache rows")
    parser.add_argument("--layers", type=int, nargs=2, default=(1, 2), help="first and last layer to print")
    args = parser.parse_args()
    _as_gpu()
    import jspec
    from jspec.bench.presets import PRESETS
    from jspec.models import forward

    config = PRESETS[args.target]
    model = jax.eval_shape(lambda key: jspec.init_params(config, key, jnp.bfloat16), jax.random.key(0))
    cache = jax.eval_shape(lambda: model.init_cache(1, args.context))
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda m, t, kv: forward(m, t, kv, impl=args.impl))(model, tokens, cache).jaxpr
    parts = stretches(_events(jaxpr))
    kernels = collections.Counter(p[1] for p in parts if p[0] == "kernel")
    starts = sum(sum(op[0] in _KERNEL_STARTS for op in p[1]) for p in parts if p[0] == "xla")
    print(f"{args.target}, impl={args.impl}: {sum(kernels.values())} Pallas calls {dict(kernels)}; "
          f"{sum(p[0] == 'xla' for p in parts)} XLA stretches holding {starts} kernel-starting ops")
    # layer boundaries: the stretches that hold the layer's attention-norm input (one per layer)
    per_layer = max(1, sum(kernels.values()) // config.num_layers)
    first, last = args.layers
    k = -1
    for part in parts:
        k += part[0] == "kernel"
        if not first * per_layer <= k < (last + 1) * per_layer:
            continue
        if part[0] == "kernel":
            print(f"== {part[1]}")
            continue
        lines = collections.OrderedDict()
        for name, shape, where in part[1]:
            lines.setdefault(where, []).append(name + ("*" if name in _KERNEL_STARTS else ""))
        for where, names in lines.items():
            print(f"   {where:38s} {' '.join(names)}")


if __name__ == "__main__":
    main()
