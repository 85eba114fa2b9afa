"""GGUF: tiny GGUF files written here and read back by transformers' GGUF loader, a real GGUF
on real text, and GGUF tokenizers as transformers builds them."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from common import MAX_NEW_TOKENS, PROMPTS, TINY, randomise_norms_and_biases, reference_outputs

# transformers parses a GGUF anew for its tokenizer, its config and its weights (gguf's reader takes each
# of a real vocabulary's ~100k strings and merges through numpy memmap slices: seconds a parse), and makes
# gguf's tensor name map anew for each of a model's modules (hundreds). Both only read their arguments,
# so within one command a file (at one size and mtime) is parsed once, a map made once per architecture
# and depth.
_parse_gguf = gguf.GGUFReader


@functools.cache
def _parsed_once(path: str, mode: str, mtime_ns: int, size: int):
    return _parse_gguf(path, mode)


def _read_gguf(path, mode="r"):
    if mode != "r":  # a writable map is not shared
        return _parse_gguf(path, mode)
    stat = os.stat(path)
    return _parsed_once(os.path.realpath(path), mode, stat.st_mtime_ns, stat.st_size)


gguf.GGUFReader = _read_gguf  # transformers imports both from gguf when it loads a file
gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)


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
