"""HF transformers oracle, run in the reference environment (Python 3.11, torch, transformers).

Not imported by the jspec tests: they call it as a subprocess (see ``tests/hf_oracle.py``)
because torch and jax live in different Python environments. It writes tiny random HF
checkpoints made by transformers itself and the outputs jspec must reproduce.

  python tests/hf_reference.py models OUT_DIR     # one sub-directory per case, see CASES
  python tests/hf_reference.py eagle3 OUT_DIR     # EAGLE-3 heads (EAGLE3_CASES) + their target
  python tests/hf_reference.py mtp OUT_DIR        # targets with an MTP layer (MTP_CASES)
  python tests/hf_reference.py gemma4 OUT_DIR     # Gemma 4 text models (GEMMA4_CASES)
"""

from __future__ import annotations

import json
import sys
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


def make_model(name: str, seed: int = 0):
    config_cls, model_cls, extra = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**TINY, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0; randomise them so they are tested.
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
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


# --- hidden-state drafters: EAGLE-3 and MTP --------------------------------------------

DRAFT_PROMPTS = [PROMPTS[0], PROMPTS[2]]
DRAFT_STEPS = 4  # chained draft steps in the references

EAGLE3_CASES = {
    # shared target embedding, reduced vocab (d2t / t2d), default aux layers [2, L//2, L-3],
    # own rope (theta 10000, no scaling) while the target uses llama3 scaling.
    "eagle3": dict(
        config=dict(hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, rope_theta=10000.0, draft_vocab_size=40),
        prefix="", own_embed=False, fc_bias=False,
    ),
    # draft hidden 48 != target 64 (target_hidden_size), own embedding, full vocab (no d2t),
    # fc bias, "model." name prefix, SGLang-style aux ids (output-of-layer -> +1), v5 rope form.
    "eagle3-own": dict(
        config=dict(hidden_size=48, intermediate_size=64, num_attention_heads=3, num_key_value_heads=1,
                    head_dim=16, target_hidden_size=64,
                    rope_parameters=dict(rope_type="llama3", rope_theta=20000.0, factor=4.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=32),
                    eagle_config=dict(eagle_aux_hidden_state_layer_ids=[0, 1, 1])),
        prefix="model.", own_embed=True, fc_bias=True,
    ),
}


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope_tables(config, positions):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rot = LlamaRotaryEmbedding(config)
    return rot(torch.zeros(1, dtype=torch.float32), positions[None])


def _causal(T):
    return torch.triu(torch.full((T, T), float("-inf")), diagonal=1)


def _eagle3_layer(W, config, e, h):
    """The EAGLE-3 midlayer over rows (e, h) [T, H] with causal attention at positions 0..T-1
    (REFERENCE §2.2; SafeAILab/EAGLE cnets.py, SpecForge llama3_eagle.py)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    eps, T = config.rms_norm_eps, e.shape[0]
    nH, nKV, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    a_in = torch.cat([_rms(e, W["midlayer.input_layernorm.weight"], eps), _rms(h, W["midlayer.hidden_norm.weight"], eps)], -1)
    q = (a_in @ W["midlayer.self_attn.q_proj.weight"].T).view(1, T, nH, hd).transpose(1, 2)
    k = (a_in @ W["midlayer.self_attn.k_proj.weight"].T).view(1, T, nKV, hd).transpose(1, 2)
    v = (a_in @ W["midlayer.self_attn.v_proj.weight"].T).view(1, T, nKV, hd).transpose(1, 2)
    cos, sin = _rope_tables(config, torch.arange(T))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = repeat_kv(k, nH // nKV), repeat_kv(v, nH // nKV)
    scores = q @ k.transpose(2, 3) * hd**-0.5 + _causal(T)
    attn = (torch.softmax(scores.float(), -1) @ v).transpose(1, 2).reshape(T, nH * hd)
    x = h + attn @ W["midlayer.self_attn.o_proj.weight"].T
    m = _rms(x, W["midlayer.post_attention_layernorm.weight"], eps)
    m = torch.nn.functional.silu(m @ W["midlayer.mlp.gate_proj.weight"].T) * (m @ W["midlayer.mlp.up_proj.weight"].T)
    return x + m @ W["midlayer.mlp.down_proj.weight"].T


def _draft_chain(step_rows, logits_of, to_target, tokens, first, feats):
    """Teacher-forced rows (t_{j+1}, feature_j) for the prompt, then DRAFT_STEPS greedy steps
    recycling the previous row's hidden. ``step_rows(tokens, hidden_in)`` runs all rows from
    scratch (causal, so earlier rows do not change); ``("recycled", j)`` in ``hidden_in``
    means row j's output hidden."""
    row_tokens = list(tokens[1:]) + [first]
    n = len(row_tokens)
    x = step_rows(row_tokens, [feats[j] for j in range(n)])
    row_logits, row_hidden = logits_of(x), x
    drafts, chain_logits = [], []
    hidden_in = [feats[j] for j in range(n)]
    for _ in range(DRAFT_STEPS):
        logits = logits_of(x[-1:])[0]
        d = int(to_target(int(torch.argmax(logits))))
        drafts.append(d)
        chain_logits.append(logits)
        row_tokens.append(d)
        hidden_in.append(("recycled", len(row_tokens) - 2))
        x = step_rows(row_tokens, hidden_in)
    return dict(row_logits=row_logits.float().numpy(), row_hidden=row_hidden.float().numpy(),
                draft_tokens=np.array(drafts), chain_logits=torch.stack(chain_logits).float().numpy())


def cmd_eagle3(out_dir: str) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    target = make_model("llama3")
    target.save_pretrained(out / "target", safe_serialization=True)
    L, Ht, V = TINY["num_hidden_layers"], TINY["hidden_size"], TINY["vocab_size"]
    for ci, (name, case) in enumerate(EAGLE3_CASES.items()):
        torch.manual_seed(100 + ci)
        cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1, vocab_size=V,
                   max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                   **case["config"])
        config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "eagle_config")})
        H, I, Vd = config.hidden_size, config.intermediate_size, cfg.get("draft_vocab_size", V)
        nH, nKV, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if "eagle_config" in cfg:
            aux = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        else:
            aux = [2, L // 2, L - 3]

        def rnd(*shape, s=0.15):
            return s * torch.randn(*shape)

        W = {
            "fc.weight": rnd(H, 3 * Ht),
            "midlayer.input_layernorm.weight": 1 + rnd(H, s=0.2),
            "midlayer.hidden_norm.weight": 1 + rnd(H, s=0.2),
            "midlayer.self_attn.q_proj.weight": rnd(nH * hd, 2 * H),
            "midlayer.self_attn.k_proj.weight": rnd(nKV * hd, 2 * H),
            "midlayer.self_attn.v_proj.weight": rnd(nKV * hd, 2 * H),
            "midlayer.self_attn.o_proj.weight": rnd(H, nH * hd),
            "midlayer.post_attention_layernorm.weight": 1 + rnd(H, s=0.2),
            "midlayer.mlp.gate_proj.weight": rnd(I, H),
            "midlayer.mlp.up_proj.weight": rnd(I, H),
            "midlayer.mlp.down_proj.weight": rnd(H, I),
            "norm.weight": 1 + rnd(H, s=0.2),
            "lm_head.weight": rnd(Vd, H, s=0.3),
        }
        if case["fc_bias"]:
            W["fc.bias"] = rnd(H)
        if case["own_embed"]:
            W["embed_tokens.weight"] = rnd(V, H, s=0.5)
        if Vd != V:
            used = torch.sort(torch.randperm(V)[:Vd]).values
            W["d2t"] = used - torch.arange(Vd)  # int64 offsets (SpecForge)
            W["t2d"] = torch.zeros(V, dtype=torch.bool)
            W["t2d"][used] = True
        case_dir = out / name
        case_dir.mkdir(parents=True, exist_ok=True)
        save_file({case["prefix"] + k: v.contiguous() for k, v in W.items()}, str(case_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        (case_dir / "config.json").write_text(json.dumps(cfg, indent=2))

        embed = W["embed_tokens.weight"] if case["own_embed"] else target.model.embed_tokens.weight.detach()
        d2t = W.get("d2t")

        def step_rows(row_tokens, hidden_in):
            e = embed[torch.tensor(row_tokens)]
            hs = []
            for hin in hidden_in:
                if isinstance(hin, tuple):  # recycled: the pre-norm output of row hin[1]
                    hs.append(step_rows.outputs[hin[1]])
                else:  # target feature concat -> fc
                    hs.append(hin @ W["fc.weight"].T + (W["fc.bias"] if "fc.bias" in W else 0))
            x = _eagle3_layer(W, config, e, torch.stack(hs))
            step_rows.outputs = x
            return x

        def logits_of(x):
            return _rms(x, W["norm.weight"], config.rms_norm_eps) @ W["lm_head.weight"].T

        def to_target(i):
            return i + int(d2t[i]) if d2t is not None else i

        refs = {}
        for pi, prompt in enumerate(DRAFT_PROMPTS):
            with torch.no_grad():
                out_t = target(torch.tensor([prompt]), output_hidden_states=True)
                first = int(torch.argmax(out_t.logits[0, -1]))
                feats = torch.cat([out_t.hidden_states[i][0] for i in aux], -1)  # [n, 3*Ht]
                r = _draft_chain(step_rows, logits_of, to_target, prompt, first, feats)
            refs |= {f"{k}_{pi}": v for k, v in r.items()} | {f"first_{pi}": np.array(first)}
        refs["aux_layers"] = np.array(aux)
        np.savez(case_dir / "reference.npz", **refs)
    (out / "prompts.json").write_text(json.dumps({"prompts": DRAFT_PROMPTS, "steps": DRAFT_STEPS}))


MTP_CASES = {
    # DeepSeek-V3 layout (model.layers.{L}.*, shared_head) on a Llama-3 target.
    "mtp-deepseek": dict(target="llama3", layer_cls="LlamaDecoderLayer", norm_cls="LlamaRMSNorm", layout="deepseek"),
    # Qwen3-Next / Qwen3.5 layout (mtp.*) on a Qwen3 target (q/k norms).
    "mtp-qwen": dict(target="qwen3", layer_cls="Qwen3DecoderLayer", norm_cls="Qwen3RMSNorm", layout="qwen3_next"),
}


def cmd_mtp(out_dir: str) -> None:
    """Targets with one MTP layer: transformers' own ``MtpLayer`` wrapped around the target's
    decoder-layer class, saved in the DeepSeek or the Qwen3-Next tensor layout."""
    import copy
    import importlib

    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpLayer

    out = Path(out_dir)
    L = TINY["num_hidden_layers"]
    for ci, (name, case) in enumerate(MTP_CASES.items()):
        target = make_model(case["target"])
        module = importlib.import_module(f"transformers.models.{_family(case['target'])}.modeling_{_family(case['target'])}")
        layer_cls, norm_cls = getattr(module, case["layer_cls"]), getattr(module, case["norm_cls"])
        config = copy.deepcopy(target.config)
        config._attn_implementation = "eager"
        torch.manual_seed(200 + ci)
        mtp = MtpLayer(config, layer_cls, norm_cls, layer_idx=0, use_post_norm=True).eval()
        with torch.no_grad():
            for pname, p in mtp.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif p.ndim == 2:
                    p.copy_(0.15 * torch.randn_like(p))
                else:
                    p.copy_(0.2 * torch.randn_like(p))
        case_dir = out / name
        target.save_pretrained(case_dir, safe_serialization=True)
        tensors = load_file(str(case_dir / "model.safetensors"))
        for pname, p in mtp.state_dict().items():
            if case["layout"] == "deepseek":
                disk = f"model.layers.{L}." + pname.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
            else:
                disk = "mtp." + (pname.replace("mtp_block.", "layers.0.").replace("post_norm.", "norm.")
                                 .replace("enorm.", "pre_fc_norm_embedding.").replace("hnorm.", "pre_fc_norm_hidden.")
                                 .replace("eh_proj.", "fc."))
            tensors[disk] = p.detach().clone().contiguous()
        if case["layout"] == "deepseek":  # duplicates DeepSeek checkpoints carry (skipped by loaders)
            tensors[f"model.layers.{L}.embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
            tensors[f"model.layers.{L}.shared_head.head.weight"] = target.lm_head.weight.detach().clone()
        save_file(tensors, str(case_dir / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((case_dir / "config.json").read_text())
        cfg["num_nextn_predict_layers" if case["layout"] == "deepseek" else "mtp_num_hidden_layers"] = 1
        (case_dir / "config.json").write_text(json.dumps(cfg, indent=2))

        rotary = target.model.rotary_emb
        embed = target.model.embed_tokens.weight.detach()
        lm_head = target.lm_head.weight.detach()

        def step_rows(row_tokens, hidden_in):
            T = len(row_tokens)
            hs = [step_rows.outputs[h[1]] if isinstance(h, tuple) else h for h in hidden_in]
            e = embed[torch.tensor(row_tokens)][None]
            pos = torch.arange(T)[None]
            x = mtp(e, torch.stack(hs)[None], position_embeddings=rotary(e, pos), attention_mask=_causal(T)[None, None],
                    position_ids=pos, past_key_values=None)[0]
            step_rows.outputs = x  # post-norm hidden: logits input and the recycled hidden
            return x

        def logits_of(x):
            return x @ lm_head.T

        refs = {}
        for pi, prompt in enumerate(DRAFT_PROMPTS):
            with torch.no_grad():
                out_t = target(torch.tensor([prompt]), output_hidden_states=True)
                first = int(torch.argmax(out_t.logits[0, -1]))
                feats = out_t.hidden_states[-1][0]  # post-final-norm (transformers v5)
                r = _draft_chain(step_rows, logits_of, lambda i: i, prompt, first, feats)
            refs |= {f"{k}_{pi}": v for k, v in r.items()} | {f"first_{pi}": np.array(first)}
        np.savez(case_dir / "reference.npz", **refs)
    (out / "prompts.json").write_text(json.dumps({"prompts": DRAFT_PROMPTS, "steps": DRAFT_STEPS}))


# --- Gemma 4 ----------------------------------------------------------------------------

_S, _F = "sliding_attention", "full_attention"
GEMMA4_TEXT = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    global_head_dim=32, max_position_embeddings=256, initializer_range=0.1, final_logit_softcapping=30.0,
)
GEMMA4_CASES = {
    # 31B-style: sliding (hd 16, 2 KV heads) and full layers (hd 32, 1 KV head, k_eq_v, proportional
    # RoPE), a window of 4 that every prompt exceeds, tied head, no PLE.
    "gemma4": dict(
        num_hidden_layers=6, layer_types=[_S, _S, _F, _S, _S, _F], sliding_window=4, attention_k_eq_v=True,
        num_global_key_value_heads=1, hidden_size_per_layer_input=0,
        rope_parameters={_S: dict(rope_type="default", rope_theta=10000.0),
                         _F: dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1e6)},
    ),
    # E-style: per-layer embeddings, the last 2 layers KV-shared (double-wide MLP there), own
    # v_proj on full layers, untied LM head, full layers with default RoPE.
    "gemma4-ple": dict(
        num_hidden_layers=6, layer_types=[_S, _F, _S, _F, _S, _F], sliding_window=6, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=160, num_kv_shared_layers=2, use_double_wide_mlp=True, tie_word_embeddings=False,
        rope_parameters={_S: dict(rope_type="default", rope_theta=5000.0),
                         _F: dict(rope_type="default", rope_theta=1e5)},
    ),
}
# Gemma4ForConditionalGeneration (text only) wrapping the "gemma4" text config; vision / audio
# tensors are added by hand, as the loader must skip them.
GEMMA4_MULTIMODAL = "gemma4-multimodal"
GEMMA4_FOREIGN_TENSORS = ("model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight",
                          "model.embed_audio.embedding_projection.weight")


def _randomize_gemma4(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in pname or pname.endswith("layer_scalar"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def cmd_gemma4(out_dir: str) -> None:
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    for ci, (name, extra) in enumerate(GEMMA4_CASES.items()):
        torch.manual_seed(300 + ci)
        model = _randomize_gemma4(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**GEMMA4_TEXT, **extra)), ci)
        model.save_pretrained(out / name, safe_serialization=True)
        np.savez(out / name / "reference.npz", **reference_outputs(model))

    torch.manual_seed(310)
    config = transformers.Gemma4Config(text_config=dict(**GEMMA4_TEXT, **GEMMA4_CASES["gemma4"]))
    model = _randomize_gemma4(transformers.Gemma4ForConditionalGeneration(config), 10)
    case_dir = out / GEMMA4_MULTIMODAL
    model.save_pretrained(case_dir, safe_serialization=True)
    tensors = load_file(str(case_dir / "model.safetensors"))
    for foreign in GEMMA4_FOREIGN_TENSORS:
        tensors[foreign] = torch.randn(4, 4)
    save_file(tensors, str(case_dir / "model.safetensors"), metadata={"format": "pt"})
    np.savez(case_dir / "reference.npz", **reference_outputs(model))
    (out / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS}))


def _family(case: str) -> str:
    return {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[case]


if __name__ == "__main__":
    commands = {"models": cmd_models, "eagle3": cmd_eagle3, "mtp": cmd_mtp, "gemma4": cmd_gemma4}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(commands)}}} ARGS...")
    commands[sys.argv[1]](*sys.argv[2:])
