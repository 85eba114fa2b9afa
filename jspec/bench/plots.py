"""The PNG beside each result: decode vs roofline, round cost and speed-up, decode-attention
bandwidth, skinny-matmul bandwidth."""

from __future__ import annotations

from jspec.bench.report import ENVIRONMENT_KEYS, pyplot
from jspec.bench.report import rows as rows_of


def decode(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    def label(r):  # the weight format where it is not bf16 (rows before --weights have none)
        fmt = "" if r.get("weights", "bf16") == "bf16" else f" {r['weights']}"
        return f"{r['target']}\nb{r['batch']} ctx{r['context']}\n{r['impl']}{fmt}"

    labels = [label(r) for r in rows]
    ax.bar(range(len(rows)), [r["roofline_fraction"] for r in rows], color="tab:blue")
    ax.axhline(0.85, color="tab:red", ls="--", label="goal 85%")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("fraction of HBM roofline")
    ax.set_title("Plain greedy decode vs roofline ((weights + KV) / copy bandwidth)")
    ax.legend()
    _save(plt, fig, path, dpi=120)


def spec(result, path):
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    rounds, e2e = rows_of(result, "round"), rows_of(result, "end_to_end")
    first = (rounds or e2e or [{}])[0]
    for batch in sorted({r["batch"] for r in rounds}):
        rs = [r for r in rounds if r["batch"] == batch]
        a1.plot([r["k"] for r in rs], [r["overhead_ratio"] for r in rs], "o-", label=f"batch {batch}")
    a1.set_xlabel("draft tokens k")
    a1.set_ylabel("round time / plain decode step")
    a1.set_title(f"{first.get('target')} + {first.get('drafter')}: round cost")
    given = [r for r in e2e if r.get("k_source", "given") == "given"]  # files before k_source: all given
    for k in sorted({r["k"] for r in given}):
        rs = [r for r in given if r["k"] == k]
        a2.plot([r["mean_acceptance_length"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"k={k}")
    chosen = [r for r in e2e if r.get("k_source") == "policy"]
    for batch in sorted({r["batch"] for r in chosen}):  # a line per batch, each point marked with its k
        rs = [r for r in chosen if r["batch"] == batch]
        a2.plot([r["mean_acceptance_length"] for r in rs], [r["speedup"] for r in rs], "s--",
                label=f"policy's k, batch {batch}")
        for r in rs:
            a2.annotate(f"k={r['k']}", (r["mean_acceptance_length"], r["speedup"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set_xlabel("mean acceptance length (tokens per verify)")
    a2.set_ylabel("speed-up over plain decode")
    a2.set_title("end to end at controlled acceptance")
    for ax in (a1, a2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    _save(plt, fig, path, dpi=120)


def decode_attention_rows(data) -> list[dict]:
    """Decode-attention rows, each with its ``set`` (grid, ragged, qscan, sweep), from a result of
    this schema or from a file recorded before it (``rows``, ``ragged``, ``qscan``, ``sweep``)."""
    if "schema" in data:
        return rows_of(data, "decode_attention")
    sets = (("grid", "rows"), ("ragged", "ragged"), ("qscan", "qscan"), ("sweep", "sweep"))
    return [dict(r, measure="decode_attention", set=which) for which, key in sets for r in data.get(key, [])]


def decode_attention_environment(data) -> dict:
    """The environment block (of a file recorded before this schema: its ``info``, completed)."""
    return data["environment"] if "schema" in data else dict.fromkeys(ENVIRONMENT_KEYS) | data["info"]


def decode_attention(data, png):
    rows = [r for r in decode_attention_rows(data) if r["set"] == "grid"]
    if not rows:
        print(f"no decode-attention grid rows: {png} not drawn")
        return
    plt = pyplot()
    queries = sorted({r["num_q"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(queries), len(batches), figsize=(4.2 * len(batches), 3.4 * len(queries)),
                             squeeze=False)
    copy = (data.get("copy_bandwidth") or {}).get("tb_s")
    names = {"pallas": "Pallas kernel", "xla": "jnp reference", "cudnn": "cuDNN dot_product_attention"}
    for qi, num_q in enumerate(queries):
        for bi, batch in enumerate(batches):
            ax = axes[qi][bi]
            sel = sorted((r for r in rows if r["num_q"] == num_q and r["batch"] == batch), key=lambda r: r["max_len"])
            for color, (impl, style) in enumerate((("pallas", "o-"), ("xla", "s--"), ("cudnn", "^:"))):
                # filled: wall time of chained calls; hollow, thin: the kernels' GPU time (profiler)
                for key, extra, suffix in (("tb_s", {}, ""), ("device_tb_s", dict(mfc="none", lw=0.8), ", GPU time")):
                    pts = [(r["max_len"], r[key].get(impl)) for r in sel if (r.get(key) or {}).get(impl)]
                    if pts:
                        ax.plot(*zip(*pts), style, color=f"C{color}", label=names[impl] + suffix, **extra)
            if copy:
                ax.axhline(copy, color="gray", lw=0.8, label=f"copy {copy:.2f} TB/s")
                ax.axhline(0.8 * copy, color="gray", lw=0.8, ls=":", label="80% of copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"batch {batch}, {num_q} query row(s)")
            ax.set_xlabel("context (KV rows)")
            ax.set_ylabel("K+V read / time (TB/s)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    env = decode_attention_environment(data)
    heads = f"Hq {rows[0]['num_q_heads']} / Hkv {rows[0]['num_kv_heads']}, head_dim {rows[0]['head_dim']}" \
        if rows and "num_q_heads" in rows[0] else "Hq 32 / Hkv 8, head_dim 128"
    fig.suptitle(f"decode attention, bf16, {heads} -- {env['device']}, jax {env['jax_version']}")
    _save(plt, fig, png, dpi=110)


def draft_attention(data, png):
    """One panel per Gemma 4 shape and query-row count: K+V read / GPU time against the context,
    a line per batch for the kernel (solid), the reference (dashed) and cuDNN (dotted)."""
    rows = rows_of(data, "draft_attention")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    queries = sorted({r["num_q"] for r in rows})
    plt = pyplot()
    fig, axes = plt.subplots(len(shapes), len(queries), figsize=(4.2 * len(queries), 3.2 * len(shapes)),
                             squeeze=False, sharey=True)
    copy = (data.get("copy_bandwidth") or {}).get("tb_s")
    for si, shape in enumerate(shapes):
        for qi, num_q in enumerate(queries):
            ax = axes[si][qi]
            for color, batch in enumerate(sorted({r["batch"] for r in rows})):
                sel = sorted((r for r in rows if (r["shape"], r["num_q"], r["batch"]) == (shape, num_q, batch)),
                             key=lambda r: r["context"])
                for impl, style in (("pallas", "o-"), ("xla", "s--"), ("cudnn", "^:")):
                    pts = [(r["context"], r["tb_s"][impl]) for r in sel if (r.get("tb_s") or {}).get(impl)]
                    if pts:
                        ax.plot(*zip(*pts), style, color=f"C{color}", label=f"{impl}, batch {batch}")
            if copy:
                ax.axhline(copy, color="gray", lw=0.8)
                ax.axhline(0.8 * copy, color="gray", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            r0 = next(r for r in rows if r["shape"] == shape)
            ax.set_title(f"{shape} (Hq {r0['num_q_heads']} / Hkv {r0['num_kv_heads']}, d {r0['head_dim']}), "
                         f"{num_q} row(s)", fontsize=8)
            ax.set_xlabel("context (rows)")
            ax.set_ylabel("K+V read / GPU time (TB/s)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    env = data["environment"]
    fig.suptitle(f"draft attention at Gemma 4 shapes, {env['dtype']} -- {env['device']}, jax {env['jax_version']} "
                 "(gray: copy bandwidth, dotted: 80%)")
    _save(plt, fig, png, dpi=100)


def matmul(data, png):
    plt = pyplot()
    meas = {(r["k"], r["n"], r["m"]): r for r in rows_of(data, "matmul") if not r.get("extra")}  # --shapes at --ms
    torch = {(r["op"], r["k"], r["n"], r["m"]): r for r in rows_of(data, "torch")}
    shapes = list(dict.fromkeys((k, n) for k, n, _ in meas))
    ms = sorted({m for _, _, m in meas})
    copy_bw = (data.get("copy_bandwidth") or {}).get("tb_s")
    has_device = any(r["tb_s"].get("device_kernel") for r in meas.values())
    fig, axes = plt.subplots(1 + has_device, len(shapes), figsize=(4.2 * len(shapes), 3.8 * (1 + has_device)),
                             sharey=True, squeeze=False)
    for col, (k, n) in enumerate(shapes):
        def ours(name):
            return [(meas.get((k, n, m)) or {}).get("tb_s", {}).get(name) for m in ms]

        def theirs(op, key):
            return [(torch.get((op, k, n, m)) or {}).get(key) for m in ms]

        tuned = [(meas.get((k, n, m)) or {}).get("tb_s", {}) for m in ms]
        lines = [("kernel (default_config at run time)", ours("kernel_default"), "o-"), ("XLA dot", ours("xla"), "s--")]
        if any("kernel_tuned" in t for t in tuned):
            lines.append(("kernel (best swept)", [t.get("kernel_tuned", t.get("kernel_default")) for t in tuned], "^:"))
        if torch:
            lines.append(("torch F.linear (CUDA graph)", theirs("linear", "tb_s"), "d-."))
        _draw(axes[0][col], lines, ms, copy_bw, f"K={k}, N={n}: wall time")
        if has_device:
            lines = [("kernel + split-K sum", ours("device_kernel"), "o-"),
                     ("kernel alone", ours("device_kernel_alone"), "o:"), ("XLA dot", ours("device_xla"), "s--")]
            if torch:
                lines += [("torch F.linear [N,K]", theirs("linear", "device_tb_s"), "d-."),
                          ("torch matmul [K,N]", theirs("matmul_kn", "device_tb_s"), "v-.")]
            _draw(axes[1][col], lines, ms, copy_bw, f"K={k}, N={n}: GPU time of the kernels")
    for row in axes:
        row[0].set_ylabel("weight TB/s")
        row[-1].legend(fontsize=7, loc="lower left")
    env = data["environment"]
    fig.suptitle(f"skinny matmul, bf16, {env['device']}, jax {env['jax_version']}")
    _save(plt, fig, png, dpi=110)
    print("wrote", png)


def accept(rows, path):
    """Mean acceptance length of jspec and HF per experiment and k (``summary`` rows)."""
    plt = pyplot()
    rows = [r for r in rows if r["measure"] == "summary"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [r["acceptance_length"] or 0 for r in rows], 0.4, label="jspec")
    ax.bar([i + 0.2 for i in x], [r.get("hf_acceptance_length") or 0 for r in rows], 0.4,
           label="HF assisted generation")
    ax.set_xticks(x, [f"{r['experiment']}\nk={r['k']}" for r in rows], fontsize=7)
    ax.set_ylabel("mean acceptance length (tokens / round)")
    ax.set_title("Real models, real prompts (fp32, greedy unless t1)")
    ax.legend()
    _save(plt, fig, path, dpi=120)


def _save(plt, fig, path, dpi):
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _draw(ax, lines, ms, copy_bw, title):
    for label, ys, style in lines:
        pts = [(m, y) for m, y in zip(ms, ys) if y]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    if copy_bw:
        ax.axhline(copy_bw, color="k", lw=0.8, label=f"copy_ {copy_bw:.2f}")
        ax.axhline(0.85 * copy_bw, color="gray", lw=0.8, ls=":", label="85% copy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms)
    ax.set_xticklabels([str(m) for m in ms])
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("M (rows)")
    ax.grid(alpha=0.3)
