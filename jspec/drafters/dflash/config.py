"""The DFlash draft's configuration, from the published ``config.json`` (z-lab/dflash
``DFlashDraftModel``): a Qwen3 config plus ``block_size``, ``num_target_layers`` and
``dflash_config: {mask_token_id, target_layer_ids}``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jspec.models.llama import LlamaConfig, from_hf_config

ARCHITECTURE = "DFlashDraftModel"
FULL, SLIDING = "full_attention", "sliding_attention"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """``layer``: the draft layers' shapes (Qwen3 layers: q/k norms; ``num_layers`` of them, their own
    RoPE); ``block_size`` B: slot 0 the last verified token, slots 1..B-1 the mask token, drafting
    B-1 tokens; ``mask_token_id``: the target-vocabulary id the mask slots embed;
    ``target_layer_ids``: the target layers whose *outputs* the draft reads (HF ``hidden_states[i +
    1]``), concatenated in this order; ``num_target_layers``: the depth the draft was trained on;
    ``layer_types``: each draft layer's attention, :data:`FULL` (the whole block, every context row)
    or :data:`SLIDING` (vLLM's rule: the block causally, and only rows less than ``sliding_window``
    positions back); None: all full."""

    layer: LlamaConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"DFlash block_size must be >= 2 (slot 0 plus at least one draft slot), got "
                             f"{self.block_size}")
        if not 0 <= self.mask_token_id < self.layer.vocab_size:
            raise ValueError(f"DFlash mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.layer.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("DFlash target_layer_ids is empty")
        types = self.layer_types or ()
        if any(t not in (FULL, SLIDING) for t in types) or types and len(types) != self.layer.num_layers:
            raise ValueError(f"DFlash layer_types must name {FULL!r} or {SLIDING!r} for each of the "
                             f"{self.layer.num_layers} layers, got {self.layer_types!r}")
        if SLIDING in types and not (self.sliding_window or 0) >= 1:
            raise ValueError(f"DFlash sliding-window layers need sliding_window >= 1, got {self.sliding_window!r}")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None for full attention."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING else None

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size - 1


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The published default: one layer mid-depth for a one-layer draft, else ``num_draft_layers``
    ids spread evenly from 1 to ``num_target_layers - 3`` (36 and 5: 1, 9, 17, 25, 33)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def is_dflash_config(cfg: dict[str, Any]) -> bool:
    return ARCHITECTURE in (cfg.get("architectures") or [])


def config_from_hf(cfg: dict[str, Any]) -> DFlashConfig:
    """The :class:`DFlashConfig` of a DFlash ``config.json`` dict (``rope_theta`` or transformers 5's
    ``rope_parameters``). Raises ``ValueError`` naming a missing or unsupported field."""
    if not is_dflash_config(cfg):
        raise ValueError(f"not a DFlash config (architectures: {cfg.get('architectures')!r}, expected "
                         f"[{ARCHITECTURE!r}])")
    dflash = cfg.get("dflash_config") or {}
    for name, value in (("block_size", cfg.get("block_size")), ("num_target_layers", cfg.get("num_target_layers")),
                        ("dflash_config.mask_token_id", dflash.get("mask_token_id"))):
        if value is None:
            raise ValueError(f"DFlash config.json is missing {name!r}")
    layer_types = cfg.get("layer_types")
    qwen3 = {k: v for k, v in cfg.items() if k not in ("layer_types", "use_sliding_window")}
    layer = from_hf_config(dict(qwen3, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                                tie_word_embeddings=False))
    ids = dflash.get("target_layer_ids")
    num_target = int(cfg["num_target_layers"])
    ids = tuple(int(i) for i in ids) if ids is not None else default_target_layer_ids(num_target, layer.num_layers)
    mixed = layer_types is not None and any(t != FULL for t in layer_types)
    window = cfg.get("sliding_window")
    return DFlashConfig(layer=layer, block_size=int(cfg["block_size"]), mask_token_id=int(dflash["mask_token_id"]),
                        target_layer_ids=ids, num_target_layers=num_target,
                        layer_types=tuple(layer_types) if mixed else None,
                        sliding_window=int(window) if mixed and window else None)
