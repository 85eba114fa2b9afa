"""Hidden-state drafters: EAGLE-3 heads (the midlayer written out in torch from the papers'
code) and MTP layers (transformers' own ``MtpLayer``), with their targets and draft chains."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

from common import PROMPTS, TINY, family, make_model

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
    (EAGLE-3, arXiv:2503.01840; SafeAILab/EAGLE cnets.py, SpecForge llama3_eagle.py)."""
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
        module = importlib.import_module(f"transformers.models.{family(case['target'])}.modeling_{family(case['target'])}")
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
