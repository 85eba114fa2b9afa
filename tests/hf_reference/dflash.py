"""DFlash drafts (arXiv 2602.06036), written out in torch from the published architecture, on a
transformers Qwen3 target: checkpoints in the published layout and the authors' greedy loop
(draft a block in one forward, verify it in one target forward, accept the longest matching
prefix, the accepted tokens' target features become context)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from common import PROMPTS, TINY, make_model

DFLASH_NEW_TOKENS = 16

DFLASH_CASES = {
    # two draft layers reading target layers [0, 2]; rope_theta; no name prefix.
    "dflash": dict(layers=2, block_size=5, ids=[0, 2], prefix="", rope=dict(rope_theta=1000.0)),
    # one draft layer, default ids (mid-depth), transformers 5's rope_parameters, "model." prefix.
    "dflash-v5": dict(layers=1, block_size=4, ids=None, prefix="model.",
                      rope=dict(rope_parameters=dict(rope_type="default", rope_theta=5000.0))),
    # a sliding-window layer (window 6, shorter than the prompts) before a full one.
    "dflash-sliding": dict(layers=2, block_size=5, ids=[1, 2], prefix="", rope=dict(rope_theta=1000.0),
                           window=6),
}
MASK_TOKEN_ID = TINY["vocab_size"] - 1


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x, positions, theta):
    """Rotate-half RoPE of ``x [T, heads, hd]`` at ``positions [T]``."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = hd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class DraftReference:
    """The draft with its context cache: ``forward(context features, their positions, block
    embeddings, block positions)`` appends the context rows' K/V to the cache and returns the block's
    final-normed hidden; the block's own K/V is never kept."""

    def __init__(self, W, cfg, theta):
        self.W, self.cfg, self.theta = W, cfg, theta
        self.cache = [(torch.zeros(0, cfg["num_key_value_heads"], cfg["head_dim"]),) * 2
                      for _ in range(cfg["num_hidden_layers"])]
        self.cached_positions = torch.zeros(0, dtype=torch.long)

    def _visible(self, layer, key_positions, query_positions):
        """Full layers: every key. Sliding ones (vLLM's rule): keys at or before the query and less than
        the window back, so the block sees itself causally."""
        if self.cfg["layer_types"][layer] != "sliding_attention":
            return torch.ones(len(query_positions), len(key_positions), dtype=torch.bool)
        gap = query_positions[:, None] - key_positions[None, :]
        return (gap >= 0) & (gap < self.cfg["sliding_window"])

    def forward(self, features, ctx_positions, block, block_positions):
        W, c, eps = self.W, self.cfg, self.cfg["rms_norm_eps"]
        nH, nKV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        context = _rms(features @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
        self.cached_positions = torch.cat([self.cached_positions, ctx_positions])
        key_positions = torch.cat([self.cached_positions, block_positions])
        x = block
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            h = _rms(x, W[p + "input_layernorm.weight"], eps)

            def kv_of(rows, positions):
                k = (rows @ W[p + "self_attn.k_proj.weight"].T).view(-1, nKV, hd)
                k = _rotate(_rms(k, W[p + "self_attn.k_norm.weight"], eps), positions, self.theta)
                return k, (rows @ W[p + "self_attn.v_proj.weight"].T).view(-1, nKV, hd)

            k_ctx, v_ctx = kv_of(context, ctx_positions)
            k_old, v_old = self.cache[i]
            self.cache[i] = (torch.cat([k_old, k_ctx]), torch.cat([v_old, v_ctx]))
            k_block, v_block = kv_of(h, block_positions)
            k = torch.cat([self.cache[i][0], k_block]).repeat_interleave(nH // nKV, dim=1)
            v = torch.cat([self.cache[i][1], v_block]).repeat_interleave(nH // nKV, dim=1)
            q = (h @ W[p + "self_attn.q_proj.weight"].T).view(-1, nH, hd)
            q = _rotate(_rms(q, W[p + "self_attn.q_norm.weight"], eps), block_positions, self.theta)
            scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
            scores = scores.masked_fill(~self._visible(i, key_positions, block_positions)[None], float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(block), nH * hd)
            x = x + attn @ W[p + "self_attn.o_proj.weight"].T
            h = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
            gate, up = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ W[p + "mlp.down_proj.weight"].T
        return _rms(x, W["norm.weight"], eps)


def _features(out, ids, rows):
    return torch.cat([out.hidden_states[i + 1][0, rows] for i in ids], -1)


def _greedy_rounds(target, draft, ids, prompt, block_size):
    """The authors' greedy loop: tokens after the prompt, the tokens accepted per round (accepted
    drafts + 1) and each round's draft logits ``[rounds, block_size - 1, vocab]``."""
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        root = int(out.logits[0, -1].argmax())
        seq = list(prompt)
        features, positions = _features(out, ids, slice(None)), torch.arange(len(seq))
        per_round, round_logits = [], []
        while len(seq) - len(prompt) < DFLASH_NEW_TOKENS:
            L = len(seq)
            block = [root] + [MASK_TOKEN_ID] * (block_size - 1)
            embedded = target.model.embed_tokens(torch.tensor(block))
            hidden = draft.forward(features, positions, embedded, torch.arange(L, L + block_size))
            logits = target.lm_head(hidden[1:])
            round_logits.append(logits)
            drafts = logits.argmax(-1).tolist()
            verify = [root] + drafts
            out = target(torch.tensor([seq + verify]), output_hidden_states=True)
            chosen = out.logits[0, L:].argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == chosen[accepted]:
                accepted += 1
            seq += verify[:accepted + 1]
            per_round.append(accepted + 1)
            features, positions = _features(out, ids, slice(L, L + accepted + 1)), torch.arange(L, L + accepted + 1)
            root = chosen[accepted]
        return seq[len(prompt):] + [root], per_round, torch.stack(round_logits)


def cmd_dflash(out_dir: str) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    target = make_model("qwen3")
    target.save_pretrained(out / "target", safe_serialization=True)
    H, V, num_target = TINY["hidden_size"], TINY["vocab_size"], TINY["num_hidden_layers"]
    for ci, (name, case) in enumerate(DFLASH_CASES.items()):
        torch.manual_seed(300 + ci)
        nH, nKV, hd, inter, layers = 4, 2, 16, 80, case["layers"]
        cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H, intermediate_size=inter,
                   num_hidden_layers=layers, num_attention_heads=nH, num_key_value_heads=nKV, head_dim=hd,
                   vocab_size=V, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu",
                   tie_word_embeddings=False,
                   layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"] if "window" in case
                   else ["full_attention"] * layers,
                   block_size=case["block_size"], num_target_layers=num_target,
                   dflash_config=dict(mask_token_id=MASK_TOKEN_ID), **case["rope"])
        if "window" in case:
            cfg["sliding_window"] = case["window"]
        if case["ids"] is not None:
            cfg["dflash_config"]["target_layer_ids"] = case["ids"]
        ids = case["ids"] or [num_target // 2]  # the published default for one draft layer

        def rnd(*shape, s=0.15):
            return s * torch.randn(*shape)

        W = {"fc.weight": rnd(H, len(ids) * H), "hidden_norm.weight": 1 + rnd(H, s=0.2), "norm.weight": 1 + rnd(H, s=0.2)}
        for i in range(layers):
            p = f"layers.{i}."
            W |= {p + "input_layernorm.weight": 1 + rnd(H, s=0.2), p + "post_attention_layernorm.weight": 1 + rnd(H, s=0.2),
                  p + "self_attn.q_proj.weight": rnd(nH * hd, H), p + "self_attn.k_proj.weight": rnd(nKV * hd, H),
                  p + "self_attn.v_proj.weight": rnd(nKV * hd, H), p + "self_attn.o_proj.weight": rnd(H, nH * hd),
                  p + "self_attn.q_norm.weight": 1 + rnd(hd, s=0.2), p + "self_attn.k_norm.weight": 1 + rnd(hd, s=0.2),
                  p + "mlp.gate_proj.weight": rnd(inter, H), p + "mlp.up_proj.weight": rnd(inter, H),
                  p + "mlp.down_proj.weight": rnd(H, inter)}
        case_dir = out / name
        case_dir.mkdir(parents=True, exist_ok=True)
        save_file({case["prefix"] + k: v.contiguous() for k, v in W.items()}, str(case_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        (case_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        theta = cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"]
        refs = {"target_layer_ids": np.array(ids)}
        for pi, prompt in enumerate(PROMPTS[:2]):
            tokens, per_round, logits = _greedy_rounds(target, DraftReference(W, cfg, theta), ids, prompt,
                                                             case["block_size"])
            refs |= {f"tokens_{pi}": np.array(tokens), f"per_round_{pi}": np.array(per_round),
                     f"logits_{pi}": logits.numpy()}
        np.savez(case_dir / "reference.npz", **refs)
    (out / "prompts.json").write_text(json.dumps({"prompts": PROMPTS[:2], "new_tokens": DFLASH_NEW_TOKENS}))
