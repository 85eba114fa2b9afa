"""Which source line each XLA kernel of a profile comes from: the step profile's kernel names
(``input_reduce_fusion_283``) looked up in an XLA dump of the optimised modules, with the fusion's
shape, kind and the library frames (``file:line function``) of the ops fused into it.

A GPU run writes the dump and the profile; this script reads them anywhere::

    XLA_FLAGS="--xla_dump_to=$OUT/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_run" \\
        PYTHONPATH=. python -m jspec.bench decode --out $OUT/e4b --targets gemma-4-e4b --batch 1 --context 512 \\
        --steps 64 --repeats 3 --impl auto
    python benchmarks/probes/hlo_kernels.py DUMP_DIR E4B_JSON --row 0   # the profile's kernels
    python benchmarks/probes/hlo_kernels.py DUMP_DIR --module jit_generate_on_device   # every fusion of the loop
    python benchmarks/probes/hlo_kernels.py DUMP_DIR step_impls.json --row auto --module jit_forward
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) fusion\(.*?kind=(\w+)(?:, calls=%(\S+?))?[,\s]")
_COMPUTATION = re.compile(r"^%(\S+) \(.*\) -> .* \{$")
_FRAME_REF = re.compile(r'op_name="([^"]*)"(?: stack_frame_id=(\d+))?')
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_LIBRARY = ("jspec/", "pallas_kernels/")


def _tables(text: str) -> dict[str, dict[int, str]]:
    """The module's source tables (file names, function names, locations, stack frames) by id."""
    tables, current = {}, None
    for line in text.splitlines():
        if line.startswith(("%", "ENTRY")):
            break
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (row := _TABLE_ROW.match(line)):
            current[int(row.group(1))] = row.group(2)
    return tables


def _fields(row: str) -> dict[str, int]:
    return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", row)}


def _frames(tables, frame_id: int) -> list[str]:
    """``file:line function`` of a stack frame and its parents, innermost first, library files only."""
    out, seen = [], set()
    while frame_id and frame_id not in seen:
        seen.add(frame_id)
        frame = _fields(tables.get("StackFrames", {}).get(frame_id, ""))
        location = _fields(tables.get("FileLocations", {}).get(frame.get("file_location_id", 0), ""))
        file = tables.get("FileNames", {}).get(location.get("file_name_id", 0), "").strip('"')
        function = tables.get("FunctionNames", {}).get(location.get("function_name_id", 0), "").strip('"')
        starts = [file.find(part) for part in _LIBRARY if part in file]
        if starts:
            out.append(f"{file[min(starts):]}:{location.get('line')} {function}")
        frame_id = frame.get("parent_frame_id", 0)
    return out


def fusions(text: str) -> dict[str, dict]:
    """Every fusion instruction of a module: kernel-style name -> shape, kind, library frames."""
    tables = _tables(text)
    bodies: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if (head := _COMPUTATION.match(line)) or line.startswith("ENTRY"):
            current = bodies.setdefault(head.group(1) if head else "ENTRY", [])
        elif current is not None:
            current.append(line)
    found = {}
    for lines in bodies.values():
        for line in lines:
            if not (m := _INSTRUCTION.match(line)):
                continue
            name, shape, kind, calls = m.groups()
            refs = [r for body_line in bodies.get(calls, []) + [line] for r in _FRAME_REF.findall(body_line)]
            sources = []
            for _, frame_id in refs:
                for frame in _frames(tables, int(frame_id or 0))[:1]:
                    if frame not in sources:
                        sources.append(frame)
            ops = sorted({op.rsplit("/", 1)[-1] for op, _ in refs})
            found[re.sub(r"[.\-]", "_", name)] = dict(shape=shape, kind=kind, ops=ops, sources=sources)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", help="the --xla_dump_to folder")
    parser.add_argument("profile", nargs="?", help="a decode JSON with step_profile, or step_impls.py's JSON "
                        "(else: every fusion)")
    parser.add_argument("--row", default="0", help="the JSON row (step_impls.py's: the impl)")
    parser.add_argument("--module", default="jit_run", help="the module's name in the dump (the decode "
                        "benchmark's step is jit_run, its loop jit_generate_on_device)")
    args = parser.parse_args()
    modules = [p for p in Path(args.dump).rglob(f"*.{args.module}.*after_optimizations.txt")
               if "buffer-assignment" not in p.name and "memory-usage" not in p.name]
    if len(modules) != 1:
        sys.exit(f"{len(modules)} modules named {args.module} in {args.dump}: {[p.name for p in modules]}")
    table = fusions(modules[0].read_text())
    if args.profile:
        rows = json.loads(Path(args.profile).read_text())["rows"]
        row = rows[args.row] if isinstance(rows, dict) else rows[int(args.row)]  # step_impls.py's: by impl
        kernels = [(k["name"], k["count"], k["ms"]) for k in row["step_profile"]["top_kernels"]]
    else:
        kernels = [(name, None, None) for name in table]
    for name, count, ms in kernels:
        info = table.get(name)
        timing = "" if count is None else f" x{count} {ms / count * 1e3:.2f} us"
        if info is None:
            print(f"{name}{timing}: (no such fusion in the module: a custom kernel)")
            continue
        print(f"{name}{timing}: {info['kind']} {info['shape']} ops {', '.join(info['ops'][:8])}")
        for source in info["sources"][:4]:
            print(f"    {source}")


if __name__ == "__main__":
    main()
