"""HF transformers oracle, run in the reference environment (Python 3.11, torch, transformers).

Not imported by the jspec tests: they call it as a subprocess (see ``tests/hf_oracle.py``)
because torch and jax live in different Python environments. It writes tiny random HF
checkpoints made by transformers itself and the outputs jspec must reproduce.

  python tests/hf_reference.py models OUT_DIR     # one sub-directory per case, see CASES
  python tests/hf_reference.py eagle3 OUT_DIR     # EAGLE-3 heads (EAGLE3_CASES) + their target
  python tests/hf_reference.py mtp OUT_DIR        # targets with an MTP layer (MTP_CASES)
  python tests/hf_reference.py gemma4 OUT_DIR     # Gemma 4 text models (GEMMA4_CASES)
  python tests/hf_reference.py gemma4-assistant OUT_DIR   # Gemma 4 assistants + targets (ASSISTANT_CASES)
  python tests/hf_reference.py tokenizer CASES_JSON OUT_DIR GGUF...   # GGUF tokenizers, see cmd_tokenizer
  python tests/hf_reference.py gguf OUT_DIR       # tiny GGUF files (GGUF_CASES) read back by transformers
  python tests/hf_reference.py gguf-real GGUF OUT_DIR   # a real GGUF on real text, see cmd_gguf_real
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


# --- Gemma 4 assistant (Frozen-KV MTP) ---------------------------------------------------

ASSISTANT_STEPS = 4  # draft tokens per round in the references
ASSISTANT_PROMPTS = [[5, 17, 42, 8, 99, 3, 61, 9], [7, 120], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
ASSISTANT_CONTINUATION = [33, 2, 150, 77]  # verify tokens after the bonus in round two (all accepted)
ASSISTANT_CASES = {
    # E-style target (PLE, own v_proj, two KV-shared layers), assistant with the tied head.
    "assistant-tied": dict(
        target=dict(num_hidden_layers=5, layer_types=[_S, _F, _S, _S, _F], sliding_window=4, num_kv_shared_layers=2,
                    hidden_size_per_layer_input=8, vocab_size_per_layer_input=160),
        assistant=dict(layer_types=[_F, _S, _F], num_attention_heads=2),
        head=dict(use_ordered_embeddings=False),
    ),
    # k_eq_v target (one full KV head) with two KV-shared layers, assistant with the centroid head;
    # its config written with global_head_dim (the released layout) instead of per_layer_config.
    "assistant-centroid": dict(
        target=dict(num_hidden_layers=6, layer_types=[_S, _S, _F, _S, _S, _F], sliding_window=5, attention_k_eq_v=True,
                    num_global_key_value_heads=1, num_kv_shared_layers=2, hidden_size_per_layer_input=0),
        assistant=dict(layer_types=[_S, _S, _S, _F], num_attention_heads=4),
        head=dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=3),
    ),
}


def _all_shared_assistant_config():
    """transformers 5.23's kv_sharing_modes raises for a config whose every layer is KV-shared,
    so Gemma4AssistantForCausalLM cannot be built from a fresh config: treat that case as all
    "reuse" (REFERENCE §2.5)."""
    from transformers.models.gemma4 import configuration_gemma4

    cls = configuration_gemma4.Gemma4TextConfig
    modes = cls.kv_sharing_modes.fget

    def patched(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return modes(self)

    cls.kv_sharing_modes = property(patched)


def _assistant_drafts(assistant, embed, token, hidden, shared_kv, position, steps):
    """SinglePositionMultiTokenCandidateGenerator's drafter loop with an explicit RoPE position
    and shared K/V (for the options transformers does not have)."""
    tokens, logits = [], []
    for _ in range(steps):
        out = assistant(inputs_embeds=torch.cat([embed(token), hidden], -1), position_ids=torch.tensor([[position]]),
                        shared_kv_states=shared_kv, use_cache=False)
        token, hidden = out.logits.argmax(-1), out.last_hidden_state
        tokens.append(int(token))
        logits.append(out.logits[0, 0])
    return np.array(tokens), torch.stack(logits).float().numpy()


def cmd_gemma4_assistant(out_dir: str) -> None:
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    _all_shared_assistant_config()
    out = Path(out_dir)
    for ci, (name, case) in enumerate(ASSISTANT_CASES.items()):
        torch.manual_seed(400 + ci)
        target_text = dict(GEMMA4_TEXT, **case["target"])
        target = _randomize_gemma4(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**target_text)), 20 + ci)
        # The assistant reads the target's K/V: same head geometry per layer type, same window.
        geometry = ("num_key_value_heads", "head_dim", "global_head_dim", "attention_k_eq_v",
                    "num_global_key_value_heads", "sliding_window", "vocab_size", "max_position_embeddings")
        text = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=len(case["assistant"]["layer_types"]),
                    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, initializer_range=0.1,
                    **{k: target_text[k] for k in geometry if k in target_text}, **case["assistant"])
        config = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=GEMMA4_TEXT["hidden_size"],
                                                    **case["head"])
        assistant = _randomize_gemma4(transformers.Gemma4AssistantForCausalLM(config), 30 + ci)
        if assistant.masked_embedding is not None:
            V = GEMMA4_TEXT["vocab_size"]
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(V))
        assistant.generation_config.num_assistant_tokens = ASSISTANT_STEPS
        target.save_pretrained(out / name / "target", safe_serialization=True)
        assistant.save_pretrained(out / name / "assistant", safe_serialization=True)
        if name == "assistant-centroid":
            cfg_path = out / name / "assistant" / "config.json"
            cfg = json.loads(cfg_path.read_text())
            layout = cfg["text_config"].pop("per_layer_config")
            cfg["text_config"]["global_head_dim"] = next(iter(layout.values()))["head_dim"]
            cfg_path.write_text(json.dumps(cfg, indent=2))

        embed = target.get_input_embeddings()
        refs = {}
        for b, prompt in enumerate(ASSISTANT_PROMPTS):
            generator = SinglePositionMultiTokenCandidateGenerator(
                assistant, embed, transformers.GenerationConfig(max_length=200)
            )
            kw = dict(use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
            with torch.no_grad():
                ids = torch.tensor([prompt])
                first = target(ids, **kw)
                bonus = first.logits[0, -1].argmax()
                ids = torch.cat([ids, bonus.view(1, 1)], 1)
                drafts, logits = generator.get_candidates(ids, {"attention_mask": torch.ones_like(ids)}, first, False, 0)
                n = len(prompt)
                refs |= {f"bonus_{b}": int(bonus), f"drafts_{b}": drafts[0, n + 1 :].numpy(),
                         f"logits_{b}": logits[0].float().numpy()}
                # The options, from the same assistant forward: RoPE at the last committed slot;
                # sliding layers shown the last W rows (the window over the committed K/V).
                hidden, token = first.hidden_states[-1][:, -1:], bonus.view(1, 1)
                shared = first.shared_kv_states
                check, _ = _assistant_drafts(assistant, embed, token, hidden, shared, n, ASSISTANT_STEPS)
                assert (check == refs[f"drafts_{b}"]).all(), "the drafter loop must reproduce the candidate generator"
                refs[f"drafts_last_committed_{b}"], refs[f"logits_last_committed_{b}"] = _assistant_drafts(
                    assistant, embed, token, hidden, shared, n - 1, ASSISTANT_STEPS)
                W = text["sliding_window"]
                windowed = {k: (kv[0][:, :, -W:], kv[1][:, :, -W:]) if k == _S else kv for k, kv in shared.items()}
                refs[f"drafts_window_{b}"], refs[f"logits_window_{b}"] = _assistant_drafts(
                    assistant, embed, token, hidden, windowed, n, ASSISTANT_STEPS)

                # Round two after a round whose verify tokens [bonus, continuation] were all accepted.
                verify = torch.cat([bonus.view(1, 1), torch.tensor([ASSISTANT_CONTINUATION])], 1)
                second = target(verify, past_key_values=first.past_key_values, **kw)
                bonus2 = second.logits[0, -1].argmax()
                ids = torch.cat([ids, verify[:, 1:], bonus2.view(1, 1)], 1)
                k = len(ASSISTANT_CONTINUATION)
                drafts, logits = generator.get_candidates(ids, {"attention_mask": torch.ones_like(ids)}, second, False, k)
                refs |= {f"bonus2_{b}": int(bonus2), f"drafts2_{b}": drafts[0, ids.shape[1] :].numpy(),
                         f"logits2_{b}": logits[0].float().numpy()}
        np.savez(out / name / "reference.npz", **refs)
    meta = dict(prompts=ASSISTANT_PROMPTS, continuation=ASSISTANT_CONTINUATION, steps=ASSISTANT_STEPS)
    (out / "prompts.json").write_text(json.dumps(meta))


def cmd_tokenizer(cases_json: str, out_dir: str, *gguf_paths: str) -> None:
    """transformers' tokenizer of each GGUF on the texts and conversations of CASES_JSON ({"texts": [...],
    "chats": [{"messages": [...], "add_generation_prompt": bool, optional "template", "tools"}]}, a
    conversation rendered by the GGUF's own template unless it names one): ids, decodes and chat renders
    into OUT_DIR/<file stem>/reference.json, and the tokenizer saved as an HF directory (with the
    generation config transformers derives from the GGUF) into OUT_DIR/<file stem>/hf."""
    cases = json.loads(Path(cases_json).read_text())
    for gguf_path in map(Path, gguf_paths):
        tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        texts = []
        for text in cases["texts"]:
            ids = tok(text).input_ids
            texts.append(dict(
                ids=ids, ids_no_special=tok(text, add_special_tokens=False).input_ids,
                decoded=tok.decode(ids), decoded_skip_special=tok.decode(ids, skip_special_tokens=True),
            ))
        chats = []
        for chat in cases["chats"]:
            kwargs = dict(add_generation_prompt=chat["add_generation_prompt"], chat_template=chat.get("template"),
                          tools=chat.get("tools"))
            chats.append(dict(
                text=tok.apply_chat_template(chat["messages"], tokenize=False, **kwargs),
                ids=tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=True, **kwargs)["input_ids"],
            ))
        out = Path(out_dir) / gguf_path.stem
        tok.save_pretrained(out / "hf")
        config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        transformers.GenerationConfig.from_model_config(config).save_pretrained(out / "hf")
        reference = dict(texts=texts, chats=chats, special_tokens=tok.special_tokens_map, vocab_size=len(tok))
        (out / "reference.json").write_text(json.dumps(reference))


# --- GGUF -----------------------------------------------------------------------------

# Tiny models written as GGUF the way llama.cpp's converter writes them (Llama's q/k rows
# permuted), in several tensor types, then loaded back by transformers' GGUF loader.
GGUF_CASES = {
    # untied head; head_dim from rope.dimension_count, vocabulary size from {arch}.vocab_size.
    "gguf-llama": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(rms_norm_eps=1e-5, rope_theta=10000.0,
                                                                    tie_word_embeddings=False)),
    # tied head (no output.weight), q/k/v biases, vocabulary size from the token list.
    "gguf-qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    # q/k norms, head_dim from attention.key_length (128: what transformers assumes for qwen3).
    "gguf-qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128, rope_theta=1e6,
                                                                    tie_word_embeddings=False)),
}
# GGUF tensor (name suffix) -> its type in the tiny files; everything else is F32.
GGUF_TENSOR_TYPES = {"token_embd.weight": "F16", "output.weight": "Q8_0", "attn_q.weight": "Q8_0",
                     "attn_k.weight": "Q8_0", "attn_v.weight": "Q5_1", "attn_output.weight": "Q8_0",
                     "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q5_0"}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: q/k rows of a head from HF's
    [2, head_dim // 2] to the interleaved [head_dim // 2, 2]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch: str, path: Path) -> None:
    """``model`` as a GGUF file of architecture ``arch`` (metadata, names and q/k permutation as
    llama.cpp's converter writes them; tensor types from GGUF_TENSOR_TYPES)."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_embedding_length(c.hidden_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(c.head_dim)
        writer.add_vocab_size(c.vocab_size)
    if arch == "qwen3":
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(c.vocab_size)])
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        module, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(module)}.{suffix}"
        w = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _llama_cpp_permute(w, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        kind = next((t for suffix, t in GGUF_TENSOR_TYPES.items() if name.endswith(suffix)), "F32")
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
        elif kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _load_gguf(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def cmd_gguf(out_dir: str) -> None:
    out = Path(out_dir)
    for ci, (name, (arch, config_cls, model_cls, extra)) in enumerate(GGUF_CASES.items()):
        torch.manual_seed(500 + ci)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**TINY, **extra)).eval()
        randomise_norms_and_biases(model)
        (out / name).mkdir(parents=True, exist_ok=True)
        path = out / name / "model.gguf"
        write_gguf(model, arch, path)
        np.savez(out / name / "reference.npz", **reference_outputs(_load_gguf(path)))
    (out / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS}))


# Real text for a real model: a chat turn that invites copying (prompt lookup drafts well), and prose.
GGUF_REAL_CHATS = [
    "Add type hints to this function and keep everything else as it is:\n\n"
    "def moving_average(values, window):\n    total = sum(values[:window])\n    averages = [total / window]\n"
    "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n"
    "        averages.append(total / window)\n    return averages\n",
]
GGUF_REAL_TEXTS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small draft model propose "
    "several tokens that the large model then checks in a single forward pass, so",
]
GGUF_REAL_NEW_TOKENS = 32


def cmd_gguf_real(gguf_path: str, out_dir: str) -> None:
    """transformers on a real GGUF (float32): the token ids of GGUF_REAL_CHATS (chat template,
    generation prompt) and GGUF_REAL_TEXTS, the first one's logits, and GGUF_REAL_NEW_TOKENS
    greedy tokens after each (EOS not stopping), into OUT_DIR/reference.npz."""
    path = Path(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = _load_gguf(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for c in GGUF_REAL_CHATS]
    prompts += [tok(t).input_ids for t in GGUF_REAL_TEXTS]
    refs = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if i == 0:
                refs["logits"] = model(ids).logits[0].float().numpy()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=GGUF_REAL_NEW_TOKENS, min_new_tokens=GGUF_REAL_NEW_TOKENS)
        refs[f"prompt_{i}"] = np.array(prompt)
        refs[f"generated_{i}"] = out[0, len(prompt):].numpy()
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    np.savez(out_path / "reference.npz", **refs)


def _family(case: str) -> str:
    return {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[case]


if __name__ == "__main__":
    commands = {
        "models": cmd_models, "eagle3": cmd_eagle3, "mtp": cmd_mtp, "gemma4": cmd_gemma4, "tokenizer": cmd_tokenizer,
        "gemma4-assistant": cmd_gemma4_assistant, "gguf": cmd_gguf, "gguf-real": cmd_gguf_real,
    }
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(commands)}}} ARGS...")
    commands[sys.argv[1]](*sys.argv[2:])
