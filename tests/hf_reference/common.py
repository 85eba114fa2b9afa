"""Tiny random Llama 3 / Qwen2 / Qwen3 models made by transformers, the prompts, and what every
command shares (run in the HF reference environment, see ``__main__.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)

CASES = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    # head_dim 32 != hidden / heads = 16: any head_dim must work.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=False)),
}

PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 120], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
MAX_NEW_TOKENS = 24


def randomise_norms_and_biases(model):
    """Default init leaves norms at 1 and biases at 0; randomise them so they are tested."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))


def make_model(name: str, seed: int = 0):
    config_cls, model_cls, extra = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**TINY, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    randomise_norms_and_biases(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def reference_outputs(model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    score_ids = rng.integers(0, TINY["vocab_size"], size=(2, 19))
    with torch.no_grad():
        logits = model(torch.tensor(score_ids)).logits.float().numpy()
    # Left-padded ragged batch, as HF batches prompts of different lengths.
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros((len(PROMPTS), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(PROMPTS):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS
        )
    return dict(score_ids=score_ids, score_logits=logits, generated=out[:, width:].numpy())


def cmd_models(out_dir: str) -> None:
    out = Path(out_dir)
    for name in CASES:
        model = make_model(name)
        model.save_pretrained(out / name, safe_serialization=True)
        model.save_pretrained(out / f"{name}-sharded", safe_serialization=True, max_shard_size="40KB")
        np.savez(out / name / "reference.npz", **reference_outputs(model))
    (out / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS}))


def family(case: str) -> str:
    """transformers' module name of a case's architecture."""
    return {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[case]
