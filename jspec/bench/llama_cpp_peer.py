"""llama.cpp (through ``llama-cpp-python``) on a GGUF file: the peer of ``jspec.bench gguf-quality``.

Runs in an environment with ``llama-cpp-python`` and numpy and imports nothing from jspec, so the
benchmark calls it with another interpreter::

    python jspec/bench/llama_cpp_peer.py < request.json > result.json

The request: ``{"model": path, "threads": int, "windows": [[ids...], ...], "prompt": [ids...],
"new_tokens": int, "repeats": int}``. Token ids come from jspec's tokenizer, so both sides score and
decode the very same ids. The answer, one JSON object:

* ``windows``: per window, ``nll`` (the negative log-likelihood of each token after the first, from
  the logits of the tokens before it, a float64 log-softmax of llama.cpp's float32 logits) and
  ``argmax`` (the top token at each of those positions). Each window is evaluated alone from an
  empty cache, in one batch (``logits_all``).
* ``decode``: greedy decoding of ``new_tokens`` tokens after ``prompt`` (the first from the
  prompt's evaluation; no end-of-sequence stop), once to warm up, then ``repeats`` timed samples
  (``seconds``, prompt evaluation included) and the ``tokens``.
"""

from __future__ import annotations

import json
import sys
import time


def nll_of(logits, ids):
    """Per-token negative log-likelihoods and argmaxes: ``logits[t]`` predicts ``ids[t + 1]``."""
    import numpy as np

    x = np.asarray(logits[: len(ids) - 1], np.float64)
    top = x.max(axis=1, keepdims=True)
    logz = np.log(np.exp(x - top).sum(axis=1)) + top[:, 0]
    target = x[np.arange(len(ids) - 1), ids[1:]]
    return (logz - target).tolist(), x.argmax(axis=1).tolist()


def main() -> int:
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    request = json.load(sys.stdin)
    threads = int(request.get("threads") or 0) or None
    out = {"windows": [], "decode": None}
    windows = request.get("windows") or []
    if windows:
        n_ctx = max(len(w) for w in windows)
        llm = Llama(model_path=request["model"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                    n_threads=threads, n_threads_batch=threads, verbose=False)
        for ids in windows:
            llm.reset()
            llm.eval(ids)
            nll, argmax = nll_of(llm.scores[: len(ids)], np.asarray(ids))
            out["windows"].append({"nll": nll, "argmax": argmax})
        del llm
    prompt, n = request.get("prompt") or [], int(request.get("new_tokens") or 0)
    if prompt and n:
        llm = Llama(model_path=request["model"], n_ctx=len(prompt) + n, n_batch=len(prompt), logits_all=False,
                    n_threads=threads, n_threads_batch=threads, verbose=False)

        vocab = llm.n_vocab()

        def last_logits():  # without logits_all, llama-cpp-python keeps no scores: read the context's last row
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))

        def greedy() -> list[int]:
            llm.reset()
            llm.eval(prompt)
            tokens = []
            while True:
                tokens.append(int(np.argmax(last_logits())))
                if len(tokens) == n:
                    return tokens
                llm.eval(tokens[-1:])

        greedy()  # warm-up
        seconds = []
        for _ in range(int(request.get("repeats") or 1)):
            start = time.perf_counter()
            tokens = greedy()
            seconds.append(time.perf_counter() - start)
        out["decode"] = {"tokens": tokens, "seconds": seconds}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
