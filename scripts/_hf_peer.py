"""HF transformers (torch) on the same shapes as a jspec benchmark: the peer in the same run.

Random bf16 weights made on the GPU from the same config; tokens/s of the decode phase by the
difference method ``(n - 1) / (T(n) - T(1))`` so prefill cancels out.
"""

from __future__ import annotations

import statistics
import time

from jspec.config import LlamaConfig


def hf_config(c: LlamaConfig):
    import transformers

    kwargs = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    if c.architecture == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(**kwargs, rope_parameters=rope), transformers.Qwen3ForCausalLM
    if c.architecture == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(**kwargs, rope_parameters=rope), transformers.Qwen2ForCausalLM
    return transformers.LlamaConfig(**kwargs, rope_parameters=rope), transformers.LlamaForCausalLM


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


def _median_time(fn, repeats):
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def tokens_per_s(model, prompt_ids, new_tokens, repeats, **generate_kwargs) -> float:
    import torch

    ids = torch.tensor(prompt_ids, device="cuda")

    def run(n):
        with torch.no_grad():
            return model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, **generate_kwargs)

    t1 = _median_time(lambda: run(1), repeats)
    tn = _median_time(lambda: run(new_tokens), repeats)
    return ids.shape[0] * (new_tokens - 1) / (tn - t1)


def peer_results(target_config, draft_config, prompt_ids, *, new_tokens, k, repeats, seed) -> dict:
    """HF tokens/s: eager generate, static cache + torch.compile, assisted (draft / self), prompt lookup."""
    import torch
    import transformers

    out = {"transformers_version": transformers.__version__, "torch_version": torch.__version__}
    target = make_model(target_config, seed)
    variants = {
        "eager_dynamic_cache": {},
        "prompt_lookup": dict(prompt_lookup_num_tokens=k),
        "assisted_self": dict(assistant_model=target),
    }
    for name, kwargs in variants.items():
        try:
            out[name] = tokens_per_s(target, prompt_ids, new_tokens, repeats, **kwargs)
        except Exception as e:  # a peer failing is a result, not a crash of the run
            out[name] = f"failed: {type(e).__name__}: {e}"[:300]
    if draft_config is not None:
        draft = make_model(draft_config, seed + 1)
        try:
            out["assisted_draft_model"] = tokens_per_s(target, prompt_ids, new_tokens, repeats, assistant_model=draft)
        except Exception as e:
            out["assisted_draft_model"] = f"failed: {type(e).__name__}: {e}"[:300]
        del draft
    try:
        out["static_cache_compiled"] = tokens_per_s(
            target, prompt_ids, new_tokens, repeats, cache_implementation="static",
            compile_config=transformers.CompileConfig(fullgraph=False),
        )
    except Exception as e:
        out["static_cache_compiled"] = f"failed: {type(e).__name__}: {e}"[:300]
    del target
    torch.cuda.empty_cache()
    return out
