"""HF transformers (torch) on the same shapes as a jspec benchmark: the peer in the same run.

Random bf16 weights made on the GPU from the same config; tokens/s of the decode phase by the
difference method ``(n - 1) / (T(n) - T(1))`` so prefill cancels out.
"""

from __future__ import annotations

from jspec.bench.timing import time_fn, torch_sync
from jspec.models.llama import LlamaConfig, to_hf_config


def hf_config(c: LlamaConfig):
    """``(transformers config, model class)`` for ``c``'s architecture."""
    import transformers

    config_class = getattr(transformers, c.architecture.removesuffix("ForCausalLM") + "Config")
    return config_class(**to_hf_config(c)), getattr(transformers, c.architecture)


def make_model(c: LlamaConfig, seed: int):
    import torch

    torch.manual_seed(seed)
    config, cls = hf_config(c)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def measure(name, model, prompt_ids, new_tokens, repeats, **generate_kwargs) -> dict:
    """An ``hf_peer`` row: tokens/s of ``model.generate`` with ``generate_kwargs``, or the error."""
    import torch

    ids = torch.tensor(prompt_ids, device="cuda")

    def run(n):
        with torch.no_grad():
            return model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, **generate_kwargs)

    try:
        t1 = time_fn(lambda: run(1), warmup=1, repeats=repeats, sync=torch_sync)
        tn = time_fn(lambda: run(new_tokens), warmup=1, repeats=repeats, sync=torch_sync)
    except Exception as e:  # a peer failing is a result, not a crash of the run
        return dict(measure="hf_peer", variant=name, tokens_per_s=None, error=f"{type(e).__name__}: {e}"[:300])
    tokens_per_s = ids.shape[0] * (new_tokens - 1) / (tn.median_s - t1.median_s)
    return dict(measure="hf_peer", variant=name, tokens_per_s=tokens_per_s, new_tokens=new_tokens,
                timings={"1_token": t1.as_dict(), f"{new_tokens}_tokens": tn.as_dict()})


def peer_results(target_config, draft_config, prompt_ids, *, new_tokens, k, repeats, seed) -> tuple[dict, list[dict]]:
    """``(versions, rows)``: HF tokens/s of eager generate, static cache + torch.compile,
    assisted generation (draft model / itself) and prompt lookup."""
    import torch
    import transformers

    versions = {"transformers_version": transformers.__version__, "torch_version": torch.__version__}
    target = make_model(target_config, seed)
    variants = {
        "eager_dynamic_cache": {},
        "prompt_lookup": dict(prompt_lookup_num_tokens=k),
        "assisted_self": dict(assistant_model=target),
    }
    rows = [measure(name, target, prompt_ids, new_tokens, repeats, **kwargs) for name, kwargs in variants.items()]
    if draft_config is not None:
        draft = make_model(draft_config, seed + 1)
        rows.append(measure("assisted_draft_model", target, prompt_ids, new_tokens, repeats, assistant_model=draft))
        del draft
    rows.append(measure("static_cache_compiled", target, prompt_ids, new_tokens, repeats, cache_implementation="static",
                        compile_config=transformers.CompileConfig(fullgraph=False)))
    del target
    torch.cuda.empty_cache()
    return versions, rows
