"""Tiny random models for tests (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import functools

import jax

import jspec

TINY = jspec.LlamaConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


def tiny_model(seed: int = 0, **overrides) -> jspec.Model:
    config = dataclasses.replace(TINY, **overrides)
    return jspec.init_params(config, jax.random.key(seed), scale=0.3)


def eagle3_head(seed, target, *, hidden=None, draft_vocab=40, aux=None, **kw):
    """A random EAGLE-3 head for ``target`` (draft vocab ``min(draft_vocab, vocab)``)."""
    from jspec.drafters import Eagle3Config, init_eagle3_head

    layer = dataclasses.replace(
        TINY, vocab_size=target.config.vocab_size, num_layers=1, rope_theta=1000.0,
        **({} if hidden is None else dict(hidden_size=hidden, num_heads=hidden // 16, num_kv_heads=1)),
    )
    config = Eagle3Config(
        layer=layer, draft_vocab_size=min(draft_vocab, layer.vocab_size),
        target_hidden_size=target.config.hidden_size, aux_layers=aux,
    )
    return init_eagle3_head(config, jax.random.key(seed), scale=0.3, **kw)


def dflash(target, *, block_size=5, ids=(0, 1), seed=1, dtype=None):
    """A random DFlash drafter for ``target`` (its vocabulary and width; the mask token its last id;
    two Qwen3 draft layers reading the outputs of target layers ``ids``)."""
    from jspec.drafters import DFlash, DFlashConfig, init_dflash_head

    c = target.config
    layer = dataclasses.replace(TINY, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=2,
                                architecture="Qwen3ForCausalLM", qk_norm=True, rope_theta=1000.0)
    config = DFlashConfig(layer=layer, block_size=block_size, mask_token_id=c.vocab_size - 1,
                          target_layer_ids=tuple(ids), num_target_layers=c.num_layers)
    return DFlash(init_dflash_head(config, jax.random.key(seed), dtype or target.embed.dtype, scale=0.3))


_S, _F = "sliding_attention", "full_attention"
# Everything Gemma 4 has: two layer geometries, k_eq_v, a window shorter than most prompts,
# per-layer embeddings, two KV-shared layers (one per type), soft-capped logits.
TINY_GEMMA4 = jspec.Gemma4Config(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_global_kv_heads=1,
    global_head_dim=32,
    layer_types=(_S, _F, _S, _F),
    sliding_window=5,
    max_position_embeddings=256,
    attention_k_eq_v=True,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=97,
    num_kv_shared_layers=2,
)


def tiny_gemma4(seed: int = 0, **overrides):
    config = dataclasses.replace(TINY_GEMMA4, **overrides)
    return _init_gemma4(config, jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=0)
def _init_gemma4(config, key):
    # One compiled program per config (whatever the seed): much faster than creating the many
    # small arrays op by op, or than tracing and compiling a new program on every call.
    return jspec.init_params(config, key, scale=0.3)


# A word-level vocabulary small enough for TINY (97 ids): whole words, split at whitespace and
# punctuation, anything else <unk>.
_WORDS = ("hello world the quick brown fox jumps over lazy dog what is speculative decoding a draft proposes "
          "target verifies you are terse , . ! ? :").split()
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_hf_tokenizer(directory) -> None:
    """An HF tokenizer directory for the tiny models, in the forms a checkpoint may take: a
    ``tokenizer.json`` without a post-processor (``tokenizer_config.json``'s ``add_bos_token`` asks
    for BOS), the chat template in ``chat_template.jinja``, and ``generation_config.json`` stopping
    at EOS and at the token closing a turn."""
    import json
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    special = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + list(_WORDS))}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=True, add_eos_token=False)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    eos_ids = [special.index("</s>"), special.index("<|end|>")]
    (directory / "generation_config.json").write_text(json.dumps(dict(eos_token_id=eos_ids)))
