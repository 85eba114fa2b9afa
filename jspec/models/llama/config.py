"""The Llama 3 / Qwen2 / Qwen3 config: frozen, hashable, built from an HF ``config.json``.

A config is static data: it rides in the ``Model`` pytree's aux data, so two models with
equal configs share one compiled program.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jspec.rope import default_inv_freq

# architecture name in config.json -> family flags
_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama 3 / Qwen2 / Qwen3 dense decoder (one family, differing by two flags)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Inverse of ``dataclasses.asdict`` (jspec checkpoints store configs as JSON)."""
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    def rope_inv_freq(self) -> np.ndarray:
        """Per-pair inverse frequencies [head_dim // 2], fp32, as HF computes them."""
        inv_freq = default_inv_freq(self.rope_theta, self.head_dim)
        s = self.rope_scaling
        if s is None:
            return inv_freq
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)


def is_llama_config(cfg: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` dict names an architecture of this family."""
    arch = (cfg.get("architectures") or [None])[0]
    return arch in _ARCHITECTURES or (arch is None and cfg.get("model_type") in _MODEL_TYPES)


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling dict) from either the old (rope_theta/rope_scaling) or the v5 form."""
    params = cfg.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type != "llama3":
            raise ValueError(f"unsupported config field rope_scaling.rope_type={rope_type!r} (supported: default, llama3)")
    return float(theta), scaling


def to_hf_config(config: LlamaConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``config`` (transformers v5's ``rope_parameters`` form), the
    inverse of :func:`from_hf_config`. An HF config derives ``qkv_bias`` / ``qk_norm`` from the
    architecture, so a config whose flags differ from its architecture's raises ``ValueError``."""
    c = config
    if c.architecture not in _ARCHITECTURES:
        raise ValueError(f"unsupported architecture {c.architecture!r} (supported: {sorted(_ARCHITECTURES)})")
    flags = dict(qkv_bias=c.qkv_bias, qk_norm=c.qk_norm)
    if flags != _ARCHITECTURES[c.architecture]:
        raise ValueError(f"config flags {flags} do not match {c.architecture} ({_ARCHITECTURES[c.architecture]}), "
                         "which an HF config.json derives them from")
    rope = {"rope_type": "default", "rope_theta": float(c.rope_theta)}
    if c.rope_scaling is not None:
        rope |= {"rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)}
    model_type = next(t for t, arch in _MODEL_TYPES.items() if arch == c.architecture)
    return dict(
        architectures=[c.architecture], model_type=model_type, vocab_size=int(c.vocab_size),
        hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size),
        num_hidden_layers=int(c.num_layers), num_attention_heads=int(c.num_heads),
        num_key_value_heads=int(c.num_kv_heads), head_dim=int(c.head_dim),
        max_position_embeddings=int(c.max_position_embeddings), rms_norm_eps=float(c.rms_norm_eps),
        rope_parameters=rope, tie_word_embeddings=bool(c.tie_word_embeddings), hidden_act="silu",
    )


def from_hf_config(cfg: dict[str, Any]) -> LlamaConfig:
    """Validate an HF ``config.json`` dict and build a ``LlamaConfig``.

    Raises ``ValueError`` naming the field for anything this family does not implement.
    """
    architectures = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type"), "")]
    arch = architectures[0]
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported config field architectures={architectures!r} "
            f"(supported: {sorted(_ARCHITECTURES)})"
        )
    flags = dict(_ARCHITECTURES[arch])

    def need(name):
        if name not in cfg:
            raise ValueError(f"config.json is missing the field {name!r}")
        return cfg[name]

    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported config field hidden_act={cfg['hidden_act']!r} (supported: 'silu')")
    if cfg.get("mlp_bias", False):
        raise ValueError("unsupported config field mlp_bias=True")
    if arch == "LlamaForCausalLM" and cfg.get("attention_bias", False):
        raise ValueError("unsupported config field attention_bias=True for LlamaForCausalLM")
    if arch == "Qwen3ForCausalLM" and cfg.get("attention_bias", False):
        raise ValueError("unsupported config field attention_bias=True for Qwen3ForCausalLM")
    if cfg.get("use_sliding_window", False):
        raise ValueError("unsupported config field use_sliding_window=True")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"unsupported config field layer_types={sorted(set(layer_types))!r} (only full_attention)")
    if cfg.get("quantization_config"):
        raise ValueError("unsupported config field quantization_config (quantized checkpoints are not supported)")

    theta, scaling = _rope_params(cfg)
    rope_scaling = None
    if scaling is not None:
        try:
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ValueError(f"config field rope_scaling is missing {e.args[0]!r} for rope_type 'llama3'") from None

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    head_dim = cfg.get("head_dim") or hidden // heads
    return LlamaConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(need("max_position_embeddings")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        architecture=arch,
        **flags,
    )
