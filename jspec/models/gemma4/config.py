"""Gemma 4 text decoder config (HF transformers ``Gemma4TextConfig``) and its construction from HF ``config.json``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jspec.rope import default_inv_freq


SLIDING, FULL = "sliding_attention", "full_attention"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Gemma4Rope:
    """RoPE of one Gemma 4 layer type: ``default``, or ``proportional`` (only the first
    ``partial_rotary_factor`` of the frequencies rotate, the rest are 0: NoPE dimensions)."""

    theta: float
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """``[head_dim // 2]`` fp32, as HF ``modeling_rope_utils`` computes it."""
        if self.rope_type == "default":
            return default_inv_freq(self.theta, head_dim)
        rotated = int(self.partial_rotary_factor * head_dim // 2)
        return (default_inv_freq(self.theta, head_dim, rotated) / self.factor).astype(np.float32)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4 dense text decoder: sliding and full layers of different geometry, optional
    per-layer embeddings (PLE) and KV sharing (E2B / E4B)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # sliding layers
    head_dim: int  # sliding layers
    num_global_kv_heads: int  # full layers
    global_head_dim: int  # full layers
    layer_types: tuple[str, ...]
    sliding_window: int  # keys visible to a query, the query included
    max_position_embeddings: int
    sliding_rope: Gemma4Rope = Gemma4Rope(10000.0)
    full_rope: Gemma4Rope = Gemma4Rope(1e6, "proportional", 0.25)
    rms_norm_eps: float = 1e-6
    attention_k_eq_v: bool = False  # full layers: no v_proj, V = v_norm(raw k_proj output)
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    hidden_size_per_layer_input: int = 0  # PLE width per layer; 0 = no PLE
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0  # the last layers reuse the K/V of an earlier layer
    use_double_wide_mlp: bool = False  # KV-shared layers get a 2x intermediate size
    architecture: str = "Gemma4ForCausalLM"

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"layer_types must hold {self.num_layers} entries of {SLIDING!r} / {FULL!r}, got {self.layer_types!r}"
            )
        for kv_heads, head_dim in {(self.num_kv_heads, self.head_dim), (self.num_global_kv_heads, self.global_head_dim)}:
            if self.num_heads % kv_heads:
                raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of {kv_heads} KV heads")
            if head_dim % 2:
                raise ValueError(f"head dims must be even for rotary embeddings, got {head_dim}")
        # All layers shared: a Gemma 4 assistant, whose layers read the K/V of its target.
        if not 0 <= self.num_kv_shared_layers <= self.num_layers:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers} out of range for {self.num_layers} layers")
        producers = set(self.layer_types[: self.first_kv_shared_layer])
        if self.num_kv_shared_layers and producers and producers != set(self.layer_types):
            raise ValueError("every layer type of a KV-shared layer needs an earlier non-shared layer of that type")
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < self.vocab_size:
            raise ValueError(
                f"vocab_size_per_layer_input={self.vocab_size_per_layer_input} < vocab_size={self.vocab_size}: "
                "token ids past it would have no per-layer embedding"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Gemma4Config:
        """Inverse of ``dataclasses.asdict`` (jspec checkpoints store configs as JSON)."""
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["sliding_rope"], d["full_rope"] = Gemma4Rope(**d["sliding_rope"]), Gemma4Rope(**d["full_rope"])
        return cls(**d)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head_dim) of ``layer``; its queries have ``num_heads`` heads of that head_dim."""
        if self.is_sliding(layer):
            return self.num_kv_heads, self.head_dim
        return self.num_global_kv_heads, self.global_head_dim

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def rope(self, layer_type: str) -> Gemma4Rope:
        return self.sliding_rope if layer_type == SLIDING else self.full_rope

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def kv_source(self, layer: int) -> int | None:
        """The layer whose K/V ``layer`` attends to: itself, or for a KV-shared layer the last
        non-shared layer of the same type (None when every layer is shared: K/V handed in from
        outside). Only layers ``< first_kv_shared_layer`` own a cache."""
        if layer < self.first_kv_shared_layer:
            return layer
        return self.last_kv_owner(self.layer_types[layer])

    def last_kv_owner(self, layer_type: str) -> int | None:
        """The last layer of ``layer_type`` that owns a cache (what KV-shared layers of that type
        and a Gemma 4 assistant read), None if there is none."""
        owners = [j for j in range(self.first_kv_shared_layer) if self.layer_types[j] == layer_type]
        return owners[-1] if owners else None

    def has_v_proj(self, layer: int) -> bool:
        return not (self.attention_k_eq_v and not self.is_sliding(layer))

    def mlp_size(self, layer: int) -> int:
        double = self.use_double_wide_mlp and layer >= self.first_kv_shared_layer
        return self.intermediate_size * (2 if double else 1)


# HF Gemma4TextConfig defaults (transformers 5.23 configuration_gemma4.py): a field missing
# from config.json takes these values there, so it must here too.
_GEMMA4_TEXT_DEFAULTS = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=None, attention_bias=False, sliding_window=512,
    layer_types=None, final_logit_softcapping=None, use_bidirectional_attention=None,
    vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
    num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, num_experts=None,
    global_head_dim=512, num_global_key_value_heads=None,
)
GEMMA4_ARCHITECTURES = {"Gemma4ForCausalLM": "gemma4_text", "Gemma4ForConditionalGeneration": "gemma4"}


def is_gemma4_config(cfg: dict[str, Any]) -> bool:
    arch = (cfg.get("architectures") or [None])[0]
    return arch in GEMMA4_ARCHITECTURES or cfg.get("model_type") in GEMMA4_ARCHITECTURES.values()


def _gemma4_rope(params: dict[str, Any] | None, default: Gemma4Rope, layer_type: str) -> Gemma4Rope:
    if params is None:
        return default
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ValueError(
            f"unsupported config field rope_parameters.{layer_type}.rope_type={rope_type!r} "
            "(supported: default, proportional)"
        )
    return Gemma4Rope(
        theta=float(params.get("rope_theta", default.theta)),
        rope_type=rope_type,
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0,
        factor=float(params.get("factor", 1.0)) if rope_type == "proportional" else 1.0,
    )


def from_hf_config(cfg: dict[str, Any]) -> Gemma4Config:
    """Validate a ``Gemma4ForCausalLM`` config.json (or the ``text_config`` of a
    ``Gemma4ForConditionalGeneration`` one) and build a ``Gemma4Config``.

    Raises ``ValueError`` naming the field for anything not implemented (MoE, attention bias,
    bidirectional attention, other activations or RoPE types).
    """
    arch = (cfg.get("architectures") or [None])[0]
    if arch == "Gemma4ForConditionalGeneration" or (arch is None and cfg.get("model_type") == "gemma4"):
        arch = "Gemma4ForConditionalGeneration"
        if not isinstance(cfg.get("text_config"), dict):
            raise ValueError("config.json of Gemma4ForConditionalGeneration is missing the field 'text_config'")
        text = cfg["text_config"]
    else:
        arch, text = "Gemma4ForCausalLM", cfg
    unknown = object()

    def field(name):
        value = text.get(name, unknown)
        return _GEMMA4_TEXT_DEFAULTS[name] if value is unknown else value

    if field("enable_moe_block") or field("num_experts"):
        raise ValueError("unsupported config field enable_moe_block=True (Gemma 4 MoE is not implemented)")
    if field("hidden_activation") != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported config field hidden_activation={field('hidden_activation')!r}")
    if field("attention_bias"):
        raise ValueError("unsupported config field attention_bias=True")
    if field("use_bidirectional_attention") == "all":
        raise ValueError("unsupported config field use_bidirectional_attention='all' (only causal attention)")
    if text.get("quantization_config") or cfg.get("quantization_config"):
        raise ValueError("unsupported config field quantization_config (quantized checkpoints are not supported)")

    num_layers = int(field("num_hidden_layers"))
    layer_types = field("layer_types")
    if layer_types is None:  # HF default: 5 sliding : 1 full
        layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]
    layer_types = list(layer_types)
    if layer_types:
        layer_types[-1] = FULL  # HF forces the last layer to full attention

    # Full-layer geometry: transformers >= 5.23 writes it as per-layer overrides, the released
    # checkpoints as global_head_dim / num_global_key_value_heads (the latter only with k_eq_v).
    k_eq_v = bool(field("attention_k_eq_v"))
    kv_heads, head_dim = int(field("num_key_value_heads")), int(field("head_dim"))
    global_kv_heads = field("num_global_key_value_heads") if k_eq_v else None
    full = {"head_dim": int(field("global_head_dim")), "num_key_value_heads": int(global_kv_heads or kv_heads)}
    overrides = text.get("per_layer_config")
    if overrides is not None:
        overrides = {int(i): dict(o) for i, o in overrides.items()}
        full_layers = [i for i, t in enumerate(layer_types) if t == FULL]
        if set(overrides) != set(full_layers) or any(overrides[i] != overrides[full_layers[0]] for i in full_layers):
            raise ValueError(
                "unsupported config field per_layer_config: only one override shared by all full-attention layers"
            )
        first = overrides[full_layers[0]]
        if set(first) - {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"unsupported config field per_layer_config keys {sorted(first)}")
        full = {"head_dim": int(first.get("head_dim", head_dim)), "num_key_value_heads": int(first.get("num_key_value_heads", kv_heads))}

    rope = field("rope_parameters") or {}
    defaults = Gemma4Config.__dataclass_fields__
    ple = int(field("hidden_size_per_layer_input") or 0)
    return Gemma4Config(
        vocab_size=int(field("vocab_size")),
        hidden_size=int(field("hidden_size")),
        intermediate_size=int(field("intermediate_size")),
        num_layers=num_layers,
        num_heads=int(field("num_attention_heads")),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_global_kv_heads=full["num_key_value_heads"],
        global_head_dim=full["head_dim"],
        layer_types=tuple(layer_types),
        sliding_window=int(field("sliding_window")),
        max_position_embeddings=int(field("max_position_embeddings")),
        sliding_rope=_gemma4_rope(rope.get(SLIDING), defaults["sliding_rope"].default, SLIDING),
        full_rope=_gemma4_rope(rope.get(FULL), defaults["full_rope"].default, FULL),
        rms_norm_eps=float(field("rms_norm_eps")),
        attention_k_eq_v=k_eq_v,
        final_logit_softcapping=None if field("final_logit_softcapping") is None else float(field("final_logit_softcapping")),
        tie_word_embeddings=bool(field("tie_word_embeddings")),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(field("vocab_size_per_layer_input")) if ple else 0,
        num_kv_shared_layers=int(field("num_kv_shared_layers") or 0),
        use_double_wide_mlp=bool(field("use_double_wide_mlp")),
        architecture=arch,
    )
