"""gguf-quality: a real GGUF file's quantization kept packed against its dequantized self, and
llama.cpp on the same file as the peer: perplexity, parameter bytes and decode speed.

For every model (a known name or a ``.gguf`` file), jspec loads the file twice: with its quantization
kept packed (``jspec.load_gguf(path, quantized=True)``) and dequantized, both in ``--dtype`` (the
packed model's scales; default float32, where the packed model is exact; variants ``jspec-packed``
and ``jspec-fp32`` / ``jspec-bf16``, the dequantized one the reference of every comparison). Then:

* **perplexity** on the committed passage (``jspec/bench/data/perplexity_passage.json``, an original
  English essay): its token ids (jspec's tokenizer, no BOS) cut into non-overlapping windows of
  ``--context`` tokens, each scored alone (``jspec.score``, batch 1); every token of a window but its
  first is predicted from the ones before it; perplexity = exp(mean negative log-likelihood), the
  log-softmax in float64. Rows also compare each variant's per-token NLL and top-1 token with the
  dequantized model's.
* **memory**: bytes of the parameter pytree (what sits on the device) packed and dequantized, and
  the file's size.
* **decode**: greedy batch-1 ``jspec.generate`` of ``--new-tokens`` tokens after the passage's first
  ``--prompt-tokens`` ids (no EOS stop, prefill included), one warm-up (the compile), then the median
  of ``--repeats`` samples.

The peer (``--llama-cpp-python PATH``: an interpreter with ``llama-cpp-python``) runs
``jspec/bench/llama_cpp_peer.py`` in a subprocess on the same file and the same token ids: the same
windows (its logits of every position, ``logits_all``) and the same greedy decode, once for each of
``--threads`` (decode rows ``llama.cpp-<N>t``: on cores other work shares, llama.cpp's OpenMP threads
wait on each other, and one thread can beat two). Resumable: a model whose rows are already in
``--out`` is not run again. ``--tiny`` writes a tiny 2-layer Llama GGUF (Q4_1 matrices, a Q8_0
table) and scores ids made of the passage's first 256 bytes; llama.cpp is not run on it (the file
has no vocabulary).

  python -m jspec.bench gguf-quality --out benchmarks/gguf_quality_cpu.json \\
      --llama-cpp-python /tmp/llamacpp-venv/bin/python   # SmolLM2-135M (Q4_1) and Qwen2.5-Coder-0.5B
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.bench import report
from jspec.bench.flags import common, subcommand
from jspec.bench.roofline import _nbytes
from jspec.bench.timing import time_fn

PASSAGE = Path(__file__).with_name("data") / "perplexity_passage.json"
PEER_SCRIPT = Path(__file__).with_name("llama_cpp_peer.py")
PACKED = "jspec-packed"
DEQUANTIZED = {"float32": "jspec-fp32", "bfloat16": "jspec-bf16"}  # by --dtype
PEER = "llama.cpp"


def dequantized_variant(dtype) -> str:
    """The dequantized model's variant name for a ``--dtype``."""
    name = jnp.dtype(dtype).name
    return DEQUANTIZED.get(name, f"jspec-{name}")


def dequantized_among(variants):
    """The dequantized model's variant among ``variants`` (None if absent)."""
    return next((v for v in variants if v not in (PACKED, PEER)), None)


def passage_text(path=PASSAGE) -> str:
    return json.loads(Path(path).read_text())["text"]


def windows_of(ids, context: int) -> list[list[int]]:
    """Non-overlapping windows of ``context`` ids (a shorter tail is dropped; one window if all are shorter)."""
    ids = list(ids)
    if len(ids) < context:
        return [ids]
    return [ids[i: i + context] for i in range(0, len(ids) - context + 1, context)]


def token_nll(logits: np.ndarray, ids) -> tuple[np.ndarray, np.ndarray]:
    """Per-token NLL (float64 log-softmax) and argmax of ``logits [T, vocab]``: row t predicts ``ids[t + 1]``."""
    ids = np.asarray(ids)
    x = np.asarray(logits[: len(ids) - 1], np.float64)
    top = x.max(axis=1, keepdims=True)
    logz = np.log(np.exp(x - top).sum(axis=1)) + top[:, 0]
    return logz - x[np.arange(len(ids) - 1), ids[1:]], x.argmax(axis=1)


def jspec_nll(model, windows) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-token NLLs and argmaxes over all windows (concatenated) and the seconds the scoring took."""
    nll, top = [], []
    start = time.perf_counter()
    for w in windows:
        logits = np.asarray(jspec.score(model, np.asarray([w], np.int32))[0])
        a, b = token_nll(logits, w)
        nll.append(a)
        top.append(b)
    return np.concatenate(nll), np.concatenate(top), time.perf_counter() - start


def perplexity_row(model_name, variant, nll, top, windows, context, reference=None, **extra) -> dict:
    row = dict(measure="perplexity", model=model_name, variant=variant, windows=len(windows), context=context,
               tokens_scored=int(nll.size), mean_nll=float(nll.mean()), perplexity=float(np.exp(nll.mean())), **extra)
    if reference is not None:
        ref_nll, ref_top = reference
        row.update(perplexity_vs_dequantized=float(np.exp(nll.mean() - ref_nll.mean()) - 1.0),
                   max_abs_nll_diff_vs_dequantized=float(np.abs(nll - ref_nll).max()),
                   mean_abs_nll_diff_vs_dequantized=float(np.abs(nll - ref_nll).mean()),
                   top1_agreement_vs_dequantized=float((top == ref_top).mean()))
    return row


def first_difference(a, b) -> int | None:
    """The first index where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_row(model_name, variant, timing_s: list[float] | None, tokens, prompt_len, new_tokens, reference=None,
               timing=None) -> dict:
    from jspec.bench.timing import Timing

    timing = timing or Timing.of(timing_s)
    row = dict(measure="decode", model=model_name, variant=variant, batch=1, prompt_tokens=prompt_len,
               new_tokens=new_tokens, tokens_per_s=new_tokens / timing.median_s,
               timings={"generate": timing.as_dict("s")}, tokens=list(tokens),
               load_average_1min=os.getloadavg()[0])  # the cores are shared: what else ran beside it
    if reference is not None:
        row.update(first_difference_vs_dequantized=first_difference(list(tokens), list(reference)))
    return row


def jspec_decode(model, prompt, new_tokens, repeats):
    """(tokens, Timing) of greedy batch-1 generation: one warm-up call, then ``repeats`` samples."""
    tokens = jspec.generate(model, [prompt], new_tokens)[0]
    timing = time_fn(lambda: jspec.generate(model, [prompt], new_tokens), warmup=0, repeats=repeats)
    return tokens, timing


def run_peer(python, path, windows, prompt, new_tokens, repeats, threads) -> dict:
    request = dict(model=str(path), threads=threads, windows=windows, prompt=prompt, new_tokens=new_tokens,
                   repeats=repeats)
    proc = subprocess.run([python, "-P", str(PEER_SCRIPT)], input=json.dumps(request), capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"the llama.cpp peer failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def tiny_gguf(path: Path) -> Path:
    """A 2-layer Llama GGUF of random weights: Q4_1 matrices, a Q8_0 table (tied head), F32 norms."""
    import gguf

    hidden, ffn, heads, kv_heads, head_dim, vocab = 128, 256, 4, 2, 32, 256
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"llama.context_length": 256, "llama.block_count": 2, "llama.feed_forward_length": ffn,
                       "llama.embedding_length": hidden, "llama.attention.head_count": heads,
                       "llama.attention.head_count_kv": kv_heads, "llama.rope.dimension_count": head_dim,
                       "llama.vocab_size": vocab}.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)

    def add(name, kind, rows, cols, scale=0.05):
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", "Q8_0", vocab, hidden)
    for i in range(2):
        for name, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            add(f"blk.{i}.{name}.weight", "Q4_1", rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def model_ids(name: str, path: Path, text: str, vocab_size: int) -> list[int]:
    if name == "tiny":
        return [b % vocab_size for b in text.encode()[:256]]
    return jspec.Tokenizer.from_pretrained(path).encode(text)


def measure_model(name: str, path: Path, args, emit) -> None:
    text = passage_text(args.passage)
    file_bytes = path.stat().st_size
    results, reference = {}, None
    dequantized = dequantized_variant(args.dtype)
    for variant in (dequantized, PACKED):  # dequantized first: the reference of the comparisons
        start = time.perf_counter()
        model = jspec.load_gguf(path, dtype=jnp.dtype(args.dtype), quantized=variant == PACKED)
        load_s = time.perf_counter() - start
        ids = model_ids(name, path, text, model.config.vocab_size)
        windows = windows_of(ids, args.context)
        prompt = ids[: args.prompt_tokens]
        nll, top, score_s = jspec_nll(model, windows)
        emit(perplexity_row(name, variant, nll, top, windows, args.context, reference, seconds=score_s,
                            passage_tokens=len(ids)))
        tokens, timing = jspec_decode(model, prompt, args.new_tokens, args.repeats)
        results[variant] = dict(bytes=_nbytes(model), load_s=load_s, tokens=tokens)
        emit(decode_row(name, variant, None, tokens, len(prompt), args.new_tokens,
                        results.get(dequantized, {}).get("tokens") if variant != dequantized else None,
                        timing=timing))
        if reference is None:
            reference = (nll, top)
        del model
        gc.collect()
    packed, plain = results[PACKED]["bytes"], results[dequantized]["bytes"]
    emit(dict(measure="memory", model=name, file=path.name, file_bytes=file_bytes, packed_bytes=packed,
              dequantized_bytes=plain, dequantized_dtype=args.dtype, packed_over_file=packed / file_bytes,
              dequantized_over_packed=plain / packed,
              load_s={v: r["load_s"] for v, r in results.items()}))
    if args.llama_cpp_python and name != "tiny":
        peer = run_peer(args.llama_cpp_python, path, windows, [], 0, 0, max(args.threads))
        nll = np.concatenate([np.asarray(w["nll"]) for w in peer["windows"]])
        top = np.concatenate([np.asarray(w["argmax"]) for w in peer["windows"]])
        emit(perplexity_row(name, PEER, nll, top, windows, args.context, reference, threads=max(args.threads)))
        for threads in args.threads:
            decode = run_peer(args.llama_cpp_python, path, [], prompt, args.new_tokens, args.repeats, threads)["decode"]
            row = decode_row(name, f"{PEER}-{threads}t", decode["seconds"], decode["tokens"], len(prompt),
                             args.new_tokens, results[dequantized]["tokens"])
            emit(dict(row, threads=threads))


def summary(rows: list[dict]) -> list[dict]:
    """Per model: each variant's perplexity and tokens/s, the bytes, packed vs dequantized and vs llama.cpp."""
    out = []
    for name in dict.fromkeys(r["model"] for r in rows if r["measure"] != "summary"):
        ppl = {r["variant"]: r["perplexity"] for r in rows if r["measure"] == "perplexity" and r["model"] == name}
        tps = {r["variant"]: r["tokens_per_s"] for r in rows if r["measure"] == "decode" and r["model"] == name}
        mem = next((r for r in rows if r["measure"] == "memory" and r["model"] == name), {})
        row = dict(measure="summary", model=name, perplexity=ppl, tokens_per_s=tps,
                   file_bytes=mem.get("file_bytes"), packed_bytes=mem.get("packed_bytes"),
                   dequantized_bytes=mem.get("dequantized_bytes"))
        dequantized = dequantized_among(ppl)
        if PACKED in ppl and dequantized:
            row["packed_over_dequantized_perplexity"] = ppl[PACKED] / ppl[dequantized] - 1.0
        if PACKED in tps and dequantized in tps:
            row["packed_over_dequantized_tokens_per_s"] = tps[PACKED] / tps[dequantized]
        if PEER in ppl and PACKED in ppl:
            row["packed_over_llama_cpp_perplexity"] = ppl[PACKED] / ppl[PEER] - 1.0
        out.append(row)
    return out


def plot(rows: list[dict], path) -> None:
    plt = report.pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows if r["measure"] != "summary"))
    peers = sorted({r["variant"] for r in rows if r["measure"] == "decode" and r["variant"].startswith(PEER)})
    palette = iter(("tab:green", "tab:olive", "tab:cyan", "tab:purple"))
    dequantized = dequantized_among(r["variant"] for r in rows if r["measure"] == "perplexity")
    colors = {PACKED: "tab:blue", dequantized: "tab:orange", PEER: "tab:green"}
    colors |= {v: next(palette, "tab:grey") for v in peers}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for measure, ax, variants in (("perplexity", axes[0], [PACKED, dequantized, PEER]),
                                  ("decode", axes[2], [PACKED, dequantized, *peers])):
        width = 0.8 / len(variants)
        for j, v in enumerate(variants):
            got = {r["model"]: r for r in rows if r["measure"] == measure and r["variant"] == v}
            xs = [i + (j - (len(variants) - 1) / 2) * width for i, m in enumerate(models) if m in got]
            if not xs:
                continue
            if measure == "perplexity":  # relative to the dequantized model's, labelled with the perplexity itself
                base = {r["model"]: r["perplexity"] for r in rows if r["measure"] == measure
                        and r["variant"] == dequantized}
                ys = [100 * (got[m]["perplexity"] / base[m] - 1) for m in models if m in got]
                labels = [f"{got[m]['perplexity']:.3f}" for m in models if m in got]
            else:
                ys = [got[m]["tokens_per_s"] for m in models if m in got]
                labels = [f"{y:.1f}" for y in ys]
            bars = ax.bar(xs, ys, width, label=v, color=colors[v])
            ax.bar_label(bars, labels=labels, fontsize=7)
        ax.set_xticks(range(len(models)), models, fontsize=8)
        ax.legend(fontsize=7)
    axes[0].axhline(0, color="grey", lw=0.8)
    axes[0].set_title(f"perplexity vs {dequantized}'s (%); labels: perplexity", fontsize=10)
    axes[2].set_title("greedy decode, batch 1 (tokens/s)", fontsize=10)
    mem = [next(r for r in rows if r["measure"] == "memory" and r["model"] == m) for m in models]
    for j, (key, label, color) in enumerate((("file_bytes", "GGUF file", "tab:grey"),
                                             ("packed_bytes", "jspec packed", "tab:blue"),
                                             ("dequantized_bytes", dequantized, "tab:orange"))):
        bars = axes[1].bar([i + (j - 1) * 0.27 for i in range(len(models))], [r[key] / 1e6 for r in mem], 0.27,
                           label=label, color=color)
        axes[1].bar_label(bars, fmt="%.3g", fontsize=7)
    axes[1].set_xticks(range(len(models)), models, fontsize=8)
    axes[1].set_title("parameter bytes (MB)", fontsize=10)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    out = Path(args.out)
    rows = [r for r in report.read(out)["rows"] if r["measure"] != "summary"] if out.exists() else []
    done = {r["model"] for r in rows if r["measure"] == "memory" and r["model"] != "tiny"}
    env = report.environment(jnp.dtype(args.dtype), args.seed, weights="real GGUF files: " + ", ".join(args.models))
    where = "CPU" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    notes = (f"{where}, {os.cpu_count()} cores; perplexity over non-overlapping windows of {args.context} token ids of "
             "jspec/bench/data/perplexity_passage.json (jspec's tokenizer, no BOS), every token but a window's first "
             "scored, float64 log-softmax; memory = bytes of the parameter pytree; decode = greedy batch 1, "
             f"{args.new_tokens} new tokens after {args.prompt_tokens} prompt ids, prefill included, median of "
             f"{args.repeats} after a warm-up; llama.cpp via llama-cpp-python fed the same ids, decoding on "
             f"{' and '.join(map(str, args.threads))} thread(s) (OpenMP); the cores may be shared (each decode row "
             "records the load average)")

    def emit(row):
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        report.write(out, report.result("gguf-quality", args.argv, env, rows + summary(rows), notes=notes))

    with tempfile.TemporaryDirectory() as tmp:
        for name in (m for m in args.models if m not in done):
            path = tiny_gguf(Path(tmp) / "tiny.gguf") if name == "tiny" else jspec.io.resolve_model(name)
            measure_model(name, Path(path), args, emit)
    plot(rows, out.with_suffix(".png"))
    for row in summary(rows):
        print(json.dumps(row))
    return 0


def register(subparsers):
    parent = common(out_help="JSON output path (a PNG plot is written beside it)", out_required=True, repeats=3,
                    dtype="float32", repeats_help="timed decode samples after a warm-up; the median is reported "
                                                  "(default 3)")
    s = subcommand(subparsers, "gguf-quality", help="a GGUF file's quantization kept packed vs dequantized vs "
                                                    "llama.cpp: perplexity, parameter bytes, decode tokens/s",
                   description=__doc__, run=run, parents=[parent],
                   tiny=dict(models=["tiny"], context=32, new_tokens=8, prompt_tokens=8, repeats=1))
    s.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"],
                   help="known model names or .gguf files ('tiny': a tiny random file written on the fly)")
    s.add_argument("--passage", default=str(PASSAGE), help="the text, JSON with a 'text' (default: the committed one)")
    s.add_argument("--context", type=int, default=512, help="tokens a perplexity window (default 512)")
    s.add_argument("--prompt-tokens", type=int, default=32, help="decode prompt: the passage's first N ids")
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count()] if os.cpu_count() > 1 else [1],
                   help="llama.cpp's decode threads, one run each (default: 1 and all cores); the scoring uses the most")
    s.add_argument("--llama-cpp-python", metavar="PYTHON", default=None,
                   help="an interpreter with llama-cpp-python: also run llama.cpp on the same file and ids")
    return s
