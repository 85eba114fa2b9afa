"""Benchmark targets: preset shapes (random weights made on the device) or checkpoints, the
``confident`` weights whose greedy continuation survives bf16 rounding, random prompts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.io import is_jspec_checkpoint, load_hf, restore
from jspec.models import AnyModel as Model
from jspec.models import gemma4
from jspec.models.gemma4 import FULL, SLIDING, Gemma4Config
from jspec.models.llama import LlamaConfig, RopeScaling
from jspec.sampling import SamplingParams
from jspec.sharding import init_sharded

GREEDY = SamplingParams()

PRESETS: dict[str, LlamaConfig | Gemma4Config] = {
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=4096,
    ),
    "tiny-draft": LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=16, max_position_embeddings=4096,
    ),
    # Every Gemma 4 feature at toy size (two attention geometries, k_eq_v, a window, per-layer
    # embeddings, KV-shared layers, softcap), for the scripts' CPU smoke runs.
    "tiny-gemma4": Gemma4Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, num_global_kv_heads=1, global_head_dim=32, layer_types=(SLIDING, FULL, SLIDING, FULL),
        sliding_window=16, max_position_embeddings=4096, attention_k_eq_v=True, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=512, num_kv_shared_layers=2,
    ),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True,
    ),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
    ),
    # Larger than one 80 GB GPU in bf16 (141 GB of weights): the tensor-parallel benchmarks (--tp 2).
    "llama-3.1-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
    ),
    "qwen3-8b": LlamaConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
        architecture="Qwen3ForCausalLM",
    ),
    # The real pairs of the acceptance benchmark (``accept``), shapes from their GGUF metadata:
    # Qwen2.5-Coder-1.5B / 0.5B-Instruct (qwen2, tied embeddings, q/k/v bias) and SmolLM2-135M-Instruct.
    "qwen2.5-coder-1.5b": LlamaConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
        head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, qkv_bias=True, architecture="Qwen2ForCausalLM",
    ),
    "qwen2.5-coder-0.5b": LlamaConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, qkv_bias=True, architecture="Qwen2ForCausalLM",
    ),
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    ),
    # Dense text decoder of Gemma-4-31B, shapes as specified for this project;
    # RoPE 1e4 default (sliding) / 1e6 proportional 0.25 (full) are the Gemma4Config defaults.
    # max_position_embeddings = 262144 (the advertised 256K context) is not from a config file.
    "gemma-4-31b": Gemma4Config(
        vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=60, num_heads=32,
        num_kv_heads=16, head_dim=256, num_global_kv_heads=4, global_head_dim=512,
        layer_types=((SLIDING,) * 5 + (FULL,)) * 10, sliding_window=1024, max_position_embeddings=262144,
        attention_k_eq_v=True, final_logit_softcapping=30.0,
    ),
    # Gemma-4-E4B text decoder: text_config values as given by public code that reads the released
    # config (rasbt/LLMs-from-scratch ch05/17_gemma4 get_gemma4_dense_config("E4B"), and an MLX Go
    # test TestParseTextConfigE4B; both agree): 42 layers, 8 heads, 2 KV heads, head_dim 256 /
    # global 512 (no k_eq_v), intermediate 10240, PLE 256 over a 262144 vocab, last 18 layers KV-shared.
    "gemma-4-e4b": Gemma4Config(
        vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_layers=42, num_heads=8,
        num_kv_heads=2, head_dim=256, num_global_kv_heads=2, global_head_dim=512,
        layer_types=((SLIDING,) * 5 + (FULL,)) * 7, sliding_window=512, max_position_embeddings=131072,
        final_logit_softcapping=30.0, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
        num_kv_shared_layers=18,
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def is_tiny(name: str) -> bool:
    return name.startswith("tiny")


def load_target(name_or_path: str, dtype, seed: int = 0, mesh=None, weights: str = "bf16") -> Model:
    """A preset (random weights made on the device; with a ``mesh``, made already placed on it) or a
    checkpoint directory (HF or jspec; placed with ``jspec.shard`` after loading); ``weights``: a
    ``jspec.quantize`` scheme to quantize it with ("bf16": as made)."""
    if weights != "bf16":  # never with a mesh (jspec.bench.flags.mesh_of refuses it)
        if name_or_path in PRESETS:
            return init_quantized(PRESETS[name_or_path], jax.random.key(seed), dtype, weights)
        return jspec.quantize(load_target(name_or_path, dtype, seed), weights)
    if name_or_path in PRESETS:
        if mesh is not None:
            return init_sharded(PRESETS[name_or_path], jax.random.key(seed), dtype, mesh)
        init = jax.jit(jspec.init_params, static_argnums=(0, 2))
        return init(PRESETS[name_or_path], jax.random.key(seed), dtype)
    path = Path(name_or_path)
    if is_jspec_checkpoint(path):
        model = jax.tree.map(lambda x: x.astype(dtype), restore(path))
    else:
        model = load_hf(path, dtype=dtype)
    return model if mesh is None else jspec.shard(model, mesh)


def init_quantized(config, key, dtype, scheme: str) -> Model:
    """``jspec.quantize(jspec.init_params(config, key, dtype), scheme)`` made one piece at a time:
    each layer is made and quantized by one program, so the unquantized model never exists (a
    70B-shaped model is 141 GB in bf16, 37 GB in int4)."""
    def quantized(fn, *, name=None, static_argnums=()):
        return jax.jit(lambda *args: jspec.quantize(fn(*args), scheme), static_argnums=static_argnums)

    model = jspec.init_params(config, key, dtype, build=quantized)  # tables come back unquantized
    return jspec.quantize(model, scheme)


def abstract_target(preset: str | LlamaConfig | Gemma4Config, dtype) -> Model:
    """The parameter shapes and dtypes of a preset (a name or a config) only: no weights made."""
    config = PRESETS[preset] if isinstance(preset, str) else preset
    return jax.eval_shape(lambda: jspec.init_params(config, jax.random.key(0), dtype))


def weights_note(names) -> str:
    """What the environment block says about the weights of these targets."""
    paths = [name for name in names if name not in PRESETS]
    return "random (generated on the device)" if not paths else "checkpoints: " + ", ".join(paths)


def confident(model: Model, seed: int = 0, residual_scale: float = 1e-2) -> Model:
    """Random weights whose greedy continuation survives bf16 rounding.

    Plain random weights give near-tied logits, so a verify forward over k+1 rows (different
    rounding than a one-row decode step) often picks another argmax, and a drafter that follows
    the target (self-drafting) is rejected. Here the LM head is a permutation of the embedding
    table and the attention / MLP outputs are scaled down, so the residual stream stays close to
    the input embedding and token ``t`` is followed by ``perm[t]`` with a wide margin. Shapes,
    bytes and FLOPs are those of the original model.
    """
    perm = jax.random.permutation(jax.random.key(seed), model.config.vocab_size)
    if isinstance(model, gemma4.Model):
        # Gemma 4 norms each branch output before the residual add, undoing a scaled o / down:
        # scale those post-norm weights instead.
        def scaled(w):
            return None if w is None else w * residual_scale

        layers = tuple(
            dataclasses.replace(layer, post_attn_norm=scaled(layer.post_attn_norm),
                                post_mlp_norm=scaled(layer.post_mlp_norm), ple_norm=scaled(layer.ple_norm))
            for layer in model.layers
        )
    else:
        layers = tuple(
            dataclasses.replace(layer, o=layer.o * residual_scale, down=layer.down * residual_scale)
            for layer in model.layers
        )
    head = None if model.lm_head is None else jnp.asarray(model.embed[perm].T)
    return dataclasses.replace(model, layers=layers, lm_head=head)


def random_prompts(batch: int, context: int, vocab: int, seed: int) -> jax.Array:
    """``[batch, context]`` int32 token ids, uniform over the vocabulary."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, vocab, size=(batch, context)), jnp.int32)
