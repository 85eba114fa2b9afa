"""HF transformers' assisted generation on real checkpoints: the peer of ``jspec.bench accept``.

Runs in an environment with torch + transformers (+ gguf, accelerate to read GGUF files) and
imports nothing from jspec, so the benchmark can call it with another interpreter (the HF
reference environment on CPU)::

    python jspec/bench/hf_assisted.py < request.json > rows.jsonl

The request: ``{"target": path, "draft": path | null, "k": int, "max_ngram": int,
"new_tokens": int, "prompts": [[ids...], ...], "device": "cpu" | "cuda"}``; a path is an HF
directory or a ``.gguf`` file. ``draft`` null means prompt lookup. One JSON line per prompt:
``{"tokens": [...], "target_forwards": n, "seconds": s}``.

Greedy, a constant draft length (``num_assistant_tokens_schedule="constant"``, confidence
threshold off), no end-of-sequence stop: every prompt yields exactly ``new_tokens`` tokens.
``target_forwards`` counts the target's forward calls; in assisted generation the first one
is the prefill together with the first verification, so it is the number of rounds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def load(path: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    kwargs = dict(dtype=torch.float32)
    if p.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def count_forwards(model) -> list[int]:
    """Wrap ``model.forward`` so that each call adds one to the returned counter."""
    counter = [0]
    inner = model.forward

    def forward(*args, **kwargs):
        counter[0] += 1
        return inner(*args, **kwargs)

    model.forward = forward
    return counter


def main() -> int:
    import torch

    request = json.load(sys.stdin)
    device = request.get("device", "cpu")
    torch.manual_seed(0)
    target = load(request["target"], device)
    k, n = int(request["k"]), int(request["new_tokens"])
    if request.get("draft"):
        draft = load(request["draft"], device)
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        assist = dict(assistant_model=draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
    else:
        assist = dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=int(request["max_ngram"]))
    counter = count_forwards(target)
    for prompt in request["prompts"]:
        ids = torch.tensor([prompt], device=device)
        counter[0] = 0
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, **assist)
        seconds = time.perf_counter() - start
        row = dict(tokens=out[0, len(prompt):].tolist(), target_forwards=counter[0], seconds=seconds)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
