"""Gemma 4 text models (incl. the multimodal layout) and the Gemma 4 assistant (Frozen-KV MTP)
with its targets and transformers' candidate generator's draft rounds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

from common import MAX_NEW_TOKENS, PROMPTS, reference_outputs

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
    "reuse"."""
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
