"""What XLA made of the on-device decode loop: the optimised HLO of ``generate_on_device``'s while
body, per ``--impl``, compiled but not run.

The profiler does not see the kernels inside the loop, so a kernel that saves GPU time in one
dispatched step can still make the loop slower (Gemma 4's RoPE + cache-write kernel: E4B's step
5.491 vs 5.684 GPU ms, its loop 5.585 vs 5.336 ms/token) without the profile saying why. This
counts what the while body runs: fusions by kind, custom calls (the Pallas kernels), and every
``copy`` with the bytes it moves (a cache buffer the loop cannot update in place is copied each
step), and which computation holds the loop (a command buffer's: one graph a step; the entry's: the
host drives each step). On a GPU (any machine compiles for its own backend)::

    PYTHONPATH=. python benchmarks/probes/loop_hlo.py gemma-4-e4b --impl auto auto,rope_write=pallas
    # writes $OUT/loop_hlo_<target>_<impl>.txt (the optimised module) and prints the summary
"""

from __future__ import annotations

import argparse
import collections
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?) (\w[\w\-]*)\(")
_WHILE = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-, %]+)\}?")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def computations(text: str) -> dict[str, list[str]]:
    """The module's computations by name: their instruction lines."""
    out, name = {}, None
    for line in text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            name = match.group(1)
            out[name] = []
        elif name and line.strip() == "}":
            name = None
        elif name:
            out[name].append(line)
    return out


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (tuples summed)."""
    return sum(_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for dtype, dims in _SHAPE.findall(shape))


def body_summary(text: str) -> dict:
    """Instructions of the outermost while loop's body, nested computations (but not fusions'
    insides) included: opcodes counted, fusions by kind, copies with their bytes."""
    comps = computations(text)
    bodies = [m.group(1) for lines in comps.values() for line in lines for m in [_WHILE.search(line)] if m]
    if not bodies:
        return {}
    largest = max(bodies, key=lambda b: len(comps.get(b, [])))
    # where the loop itself sits: inside a command buffer's computation (one graph a step) or not
    holder = next((name for name, lines in comps.items()
                   if any(re.search(rf"body=%?{re.escape(largest)}\b", line) for line in lines)), None)
    opcodes, fusions, copies, seen = collections.Counter(), collections.Counter(), [], set()

    def visit(name):
        if name in seen or name not in comps:
            return
        seen.add(name)
        for line in comps[name]:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            _, shape, opcode = match.groups()
            opcodes[opcode] += 1
            if opcode == "fusion":
                kind = re.search(r"kind=(\w+)", line)
                fusions[kind.group(1) if kind else "?"] += 1
                continue  # a fusion's inside is one kernel
            if opcode in ("copy", "copy-start"):
                copies.append(dict(shape=shape, bytes=shape_bytes(shape)))
            for called in _CALLED.findall(line):
                for callee in called.replace("%", "").split(","):
                    visit(callee.strip())

    visit(largest)
    largest_copies = sorted(copies, key=lambda c: -c["bytes"])[:8]
    return dict(body=largest, loop_in=holder, command_buffers=sum("command_buffer" in name for name in comps),
                opcodes=dict(opcodes.most_common()), fusions=dict(fusions),
                custom_calls=opcodes["custom-call"], copies=len(copies),
                copy_bytes=sum(c["bytes"] for c in copies), largest_copies=largest_copies)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a preset of jspec.bench.presets")
    parser.add_argument("--impl", nargs="+", default=["auto"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    from jspec import engine
    from jspec.bench.presets import GREEDY, PRESETS

    import jspec

    config = PRESETS[args.target]
    model = jax.eval_shape(lambda key: jspec.init_params(config, key, jnp.bfloat16), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, args.context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    width = engine.output_width(args.steps)
    max_len = engine.cache_length(args.context, args.context + width)
    out_dir = os.environ.get("OUT", "/tmp")
    for impl in args.impl:
        lowered = engine.generate_on_device.trace(
            model, tokens, lengths, jax.random.key(0), jnp.int32(args.steps), params=GREEDY, eos_ids=(),
            output_width=width, max_len=max_len, impl=impl).lower()
        text = lowered.compile().as_text()
        with open(os.path.join(out_dir, f"loop_hlo_{args.target}_{impl.replace(',', '_')}.txt"), "w") as f:
            f.write(text)
        summary = body_summary(text)
        print(impl, {k: v for k, v in summary.items() if k != "opcodes"}, flush=True)
        print("   opcodes", dict(list(summary.get("opcodes", {}).items())[:20]), flush=True)


if __name__ == "__main__":
    main()
