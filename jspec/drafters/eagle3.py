"""EAGLE-3: one draft layer over the concatenated target hidden states (Li et al., arXiv:2503.01840).

Per draft row (token ``t`` at ``j+1``, hidden ``g`` at ``j``)::

    e = embed(t)                          # the target's table unless the head stores its own
    h = fc(g)   if g is the 3*H_t target feature concat   else g   (own recycled hidden)
    x = h + attn(cat(input_layernorm(e), hidden_norm(h)))          # q/k/v read 2H-wide rows
    x = x + mlp(post_attention_layernorm(x))
    logits_draft = lm_head(norm(x))       # reduced vocab; target id = i + d2t[i]
    recycled hidden = x                   # pre-norm

As in SafeAILab/EAGLE ``eagle/model/cnets.py`` and SpecForge ``specforge/modeling/draft/llama3_eagle.py``.
The layer uses the head's own RoPE settings. Captured target layers: HF ``hidden_states``
indices (input of layer i), default ``[2, L//2, L-3]`` resolved by :meth:`Eagle3.bind`.

Checkpoints: the HF ``LlamaForCausalLMEagle3`` layout (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``; names with or without a ``model.`` prefix). Usage::

    drafter = jspec.drafters.Eagle3.load("EAGLE3-LLaMA3.1-Instruct-8B")
    jspec.speculative_generate(target, drafter, prompts, 64)
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters.hidden_state import HiddenStateDrafter, require_llama_target
from jspec.execution import DEFAULT, Execution
from jspec.parallel import COLUMN, ROW, TensorParallel, split
from jspec.io.orbax import write_hf_directory
from jspec.io.safetensors import TensorReader, check_tensors, checkpoint_dtype, read_json, tensor_files
from jspec.layers import embedding, linear, rms_norm
from jspec.models.base import Capture, random_matrix, random_norm_weight
from jspec.models.llama import Layer, LlamaConfig, Model, from_hf_config, init_layer
from jspec.models.llama.weights import layer_arrays, layer_tensors, read_layer
from jspec.quant import MATMUL_WEIGHT, TABLE_WEIGHT, in_features

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layer: LlamaConfig  # the midlayer (own RoPE); vocab_size = the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None = None  # HF hidden_states indices; None = [2, L//2, L-3]
    num_aux: int = 3

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Head:
    """EAGLE-3 parameters; linear weights ``[in, out]``."""

    fc: jax.Array = dataclasses.field(metadata=MATMUL_WEIGHT)  # [num_aux * H_t, H]
    hidden_norm: jax.Array  # [H]   midlayer.hidden_norm (on fc output / recycled hidden)
    layer: Layer  # attn_norm = midlayer.input_layernorm (on the embedding); qkv [2H, q + 2kv]
    norm: jax.Array  # [H]
    lm_head: jax.Array = split(COLUMN, metadata=MATMUL_WEIGHT)  # [H, V_d]
    d2t: jax.Array | None  # [V_d] int32 offsets: target id = i + d2t[i]; None when V_d == V
    embed: jax.Array | None = split(ROW, metadata=TABLE_WEIGHT)  # [V, H] own embedding, None = the target's
    fc_bias: jax.Array | None = None  # [H]
    fc_norm: tuple[jax.Array, ...] | None = None  # SpecForge fc_norm: one [H_t] norm per chunk
    config: Eagle3Config = dataclasses.field(default=None, metadata=dict(static=True))


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3(HiddenStateDrafter):
    """EAGLE-3 drafter (API): ``Eagle3(head)``; ``bind(target)`` (done by
    ``speculative_generate``) attaches the target's embedding and resolves the captured layers."""

    head: Eagle3Head
    embed: jax.Array | None = split(ROW, metadata=TABLE_WEIGHT, default=None)  # the target's table, set by bind when the head has none
    aux_layers: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))
    # The target's kernels, set by bind (one impl= for target and drafter); never a placement.
    execution: Execution = dataclasses.field(default=DEFAULT, metadata=dict(static=True))
    # The target's placement of ``embed``, set by bind: its lookups run per device.
    table_placement: TensorParallel | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def load(cls, path, *, dtype=None) -> Eagle3:
        """The drafter from an EAGLE-3 head directory (see the module docstring)."""
        return cls(load_head(path, dtype=dtype))

    # --- protocol ---------------------------------------------------------------------

    def captured_layers(self, num_layers: int | None = None) -> tuple[int, ...]:
        """The target layers whose inputs the head reads: the drafter's own setting, else the head's
        config, else the published default for a target of ``num_layers`` layers."""
        layers = self.aux_layers or self.head.config.aux_layers
        if layers is None and num_layers is None:
            raise ValueError("Eagle3: the captured target layers depend on the target's depth; call drafter.bind(target)")
        return tuple(layers or default_aux_layers(num_layers))

    @property
    def capture(self) -> Capture:
        return Capture(residuals=self.captured_layers())

    def max_positions(self) -> None:
        return None  # positions are the target's; RoPE has no hard limit

    def check_compatible(self, target: Model) -> None:
        require_llama_target(target, "EAGLE-3")
        hc, tc = self.head.config, target.config
        if hc.layer.vocab_size != tc.vocab_size:
            raise ValueError(f"EAGLE-3 head vocab_size {hc.layer.vocab_size} != target vocab_size {tc.vocab_size}")
        layers = self.captured_layers(tc.num_layers)
        bad = [i for i in layers if not 0 <= i < tc.num_layers]
        if bad:
            raise ValueError(
                f"EAGLE-3 aux hidden-state layer ids {list(layers)} are out of range for a target with "
                f"{tc.num_layers} layers (valid: 0..{tc.num_layers - 1}, HF hidden_states indexing)"
            )
        fc_in = in_features(self.head.fc)
        if fc_in != len(layers) * tc.hidden_size:
            raise ValueError(
                f"EAGLE-3 fc.weight takes {fc_in} inputs but the target gives {len(layers)} x hidden_size "
                f"{tc.hidden_size} = {len(layers) * tc.hidden_size} (wrong fc width for this target)"
            )
        if self.head.embed is None and target.embed.shape[1] != hc.hidden_size:
            raise ValueError(
                f"EAGLE-3 head has no embed_tokens and its hidden_size {hc.hidden_size} != the target's "
                f"embedding width {target.embed.shape[1]}"
            )

    def bind(self, target: Model) -> Eagle3:
        self.check_compatible(target)
        return dataclasses.replace(
            self, embed=None if self.head.embed is not None else target.embed,
            aux_layers=self.captured_layers(target.config.num_layers),
            execution=Execution(target.execution.kernels), table_placement=target.execution.placement,
        )

    # --- HiddenStateDrafter hooks -----------------------------------------------------

    @property
    def layer(self) -> Layer:
        return self.head.layer

    @property
    def layer_config(self) -> LlamaConfig:
        return self.head.config.layer

    def _embed(self, tokens):
        if self.head.embed is not None:
            return self.head.embed[tokens]
        if self.embed is None:
            raise ValueError("Eagle3: the head has no embedding; call drafter.bind(target) first")
        return embedding(self.embed, tokens, self.table_placement)

    def fc(self, g):
        """``[..., num_aux * H_t]`` target features -> ``[..., H]``."""
        head, eps = self.head, self.layer_config.rms_norm_eps
        g = g.astype(head.fc.dtype)
        if head.fc_norm is not None:
            chunks = jnp.split(g, len(head.fc_norm), axis=-1)
            g = jnp.concatenate([rms_norm(x, w, eps, self.execution) for x, w in zip(chunks, head.fc_norm)], axis=-1)
        return linear(g, head.fc, head.fc_bias, self.execution)

    def layer_inputs(self, tokens, g, from_target: bool):
        eps = self.layer_config.rms_norm_eps
        e = self._embed(tokens).astype(self.head.norm.dtype)
        h = self.fc(g) if from_target else g
        attn_in = jnp.concatenate([rms_norm(e, self.head.layer.attn_norm, eps, self.execution),
                                   rms_norm(h, self.head.hidden_norm, eps, self.execution)], -1)
        return h, attn_in

    def recycle(self, x):
        return x

    def head_logits(self, x):
        h = rms_norm(x, self.head.norm, self.layer_config.rms_norm_eps, self.execution)
        return linear(h, self.head.lm_head, None, self.execution).astype(jnp.float32)

    def to_target(self, ids):
        return ids if self.head.d2t is None else ids + self.head.d2t[ids]

    def draft_vocab_to_target(self, logits):
        if self.head.d2t is None:
            return logits
        vocab = self.layer_config.vocab_size
        hot = jnp.arange(logits.shape[-1], dtype=jnp.int32) + self.head.d2t
        full = jnp.full(logits.shape[:-1] + (vocab,), -jnp.inf, logits.dtype)
        return full.at[..., hot].set(logits)

    def target_features(self, features):
        return jnp.concatenate(features, axis=-1)


def init_eagle3_head(
    config: Eagle3Config, key, dtype=jnp.float32, *, scale: float = 0.02, own_embed: bool = False, fc_bias: bool = False
) -> Eagle3Head:
    """Random EAGLE-3 parameters generated where jax runs (tests, benchmarks).

    ``d2t`` maps the draft vocab onto a random sorted subset of the target vocab when
    ``draft_vocab_size < vocab_size``.
    """
    c = config.layer
    H = c.hidden_size
    k = jax.random.split(key, 8)
    normal = functools.partial(random_matrix, dtype=dtype, scale=scale)
    norm = functools.partial(random_norm_weight, dtype=dtype)

    d2t = None
    if config.draft_vocab_size < c.vocab_size:
        hot = jnp.sort(jax.random.permutation(k[0], c.vocab_size)[: config.draft_vocab_size])
        d2t = (hot - jnp.arange(config.draft_vocab_size)).astype(jnp.int32)
    return Eagle3Head(
        fc=normal(k[1], (config.num_aux * config.target_hidden_size, H)),
        hidden_norm=norm(k[2], (H,)),
        layer=init_layer(c, k[3], dtype, scale=scale, in_size=2 * H),
        norm=norm(k[4], (H,)),
        lm_head=normal(k[5], (H, config.draft_vocab_size)),
        d2t=d2t,
        embed=normal(k[6], (c.vocab_size, H)) if own_embed else None,
        fc_bias=normal(k[7], (H,)) if fc_bias else None,
        config=config,
    )


# ---------------------------------------------------------------------------------------
# checkpoints


def is_eagle3_config(cfg: dict) -> bool:
    return any(a in ARCHITECTURES for a in cfg.get("architectures") or [])


def _aux_layers(cfg: dict) -> tuple[int, ...] | None:
    """Captured target layers in HF ``hidden_states`` indexing, whatever convention the config's ids use."""
    if cfg.get("aux_layers_hf_index") is not None:  # jspec's canonical field
        ids = [int(i) for i in cfg["aux_layers_hf_index"]]
    elif (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") is not None:
        # SGLang / SpecForge: ids of the layers whose *output* is taken -> +1.
        ids = [int(i) + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    elif cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
        # vLLM speculators: input-of-layer ids, as HF hidden_states.
        ids = [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    else:
        return None
    if not ids or any(i < 0 for i in ids):
        raise ValueError(f"EAGLE-3 aux hidden-state layer ids {ids} are out of range (must be >= 0)")
    return tuple(ids)


def config_from_hf(cfg: dict) -> Eagle3Config:
    """The head config of an EAGLE-3 ``config.json`` dict."""
    layers = cfg.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"unsupported EAGLE-3 config field num_hidden_layers={layers} (supported: 1)")
    if cfg.get("norm_output"):
        raise ValueError("unsupported EAGLE-3 config field norm_output=True")
    layer_cfg = dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
    layer = from_hf_config(layer_cfg)
    draft_vocab = int(cfg.get("draft_vocab_size") or layer.vocab_size)
    if draft_vocab > layer.vocab_size:
        raise ValueError(f"EAGLE-3 draft_vocab_size {draft_vocab} > vocab_size {layer.vocab_size}")
    aux = _aux_layers(cfg)
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(cfg.get("target_hidden_size") or layer.hidden_size),
        aux_layers=aux,
        num_aux=len(aux) if aux is not None else 3,
    )


def load_head(path, *, dtype=None) -> Eagle3Head:
    """Load an EAGLE-3 head directory (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``)."""
    path = Path(path)
    cfg = read_json(path / "config.json")
    if not is_eagle3_config(cfg):
        raise ValueError(
            f"{path} is not an EAGLE-3 head (architectures: {cfg.get('architectures')!r}, "
            f"expected one of {ARCHITECTURES})"
        )
    config = config_from_hf(cfg)
    c, H, V, Vd = config.layer, config.hidden_size, config.layer.vocab_size, config.draft_vocab_size
    files = tensor_files(path)
    reader = TensorReader(files, {(n[len("model.") :] if n.startswith("model.") else n): n for n in files})
    names = reader.names
    expected = {
        "fc.weight": (H, config.num_aux * config.target_hidden_size),
        "midlayer.hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
    }
    expected |= layer_tensors(c, "midlayer.", in_size=2 * H)
    if Vd != V:
        for name in ("d2t", "t2d"):
            if name not in names:
                raise ValueError(
                    f"EAGLE-3 checkpoint is missing {name!r}: draft_vocab_size {Vd} != vocab_size {V} needs the "
                    "draft-to-target vocabulary map"
                )
    for name, shape in (("d2t", (Vd,)), ("t2d", (V,)), ("fc.bias", (H,)), ("embed_tokens.weight", (V, H))):
        if name in names:
            expected[name] = shape
    if cfg.get("fc_norm"):
        expected |= {f"fc_norm.{i}.weight": (config.target_hidden_size,) for i in range(config.num_aux)}
    with reader:
        check_tensors(reader, names, expected)
        get = reader.getter(checkpoint_dtype(reader, "fc.weight", dtype))
        d2t = None
        if "d2t" in names:
            d2t = reader.get("d2t").astype(np.int64)
            hot = np.arange(Vd) + d2t
            if hot.min() < 0 or hot.max() >= V:
                raise ValueError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary [0, {V})")
            d2t = jnp.asarray(d2t.astype(np.int32))
        return Eagle3Head(
            fc=jnp.asarray(get("fc.weight", True)),
            hidden_norm=jnp.asarray(get("midlayer.hidden_norm.weight")),
            layer=read_layer(get, c, "midlayer."),
            norm=jnp.asarray(get("norm.weight")),
            lm_head=jnp.asarray(get("lm_head.weight", True)),
            d2t=d2t,
            embed=jnp.asarray(get("embed_tokens.weight")) if "embed_tokens.weight" in names else None,
            fc_bias=jnp.asarray(get("fc.bias")) if "fc.bias" in names else None,
            fc_norm=(
                tuple(jnp.asarray(get(f"fc_norm.{i}.weight")) for i in range(config.num_aux))
                if cfg.get("fc_norm")
                else None
            ),
            config=config,
        )


def save_head(head: Eagle3Head, path, *, metadata: dict | None = None) -> None:
    """Write ``head`` as an HF ``LlamaForCausalLMEagle3`` directory (``config.json`` +
    ``model.safetensors``, the tensor names of :func:`load_head`; ``d2t`` int64 offsets and ``t2d``
    bool), readable by :meth:`Eagle3.load` and by other engines' EAGLE-3 loaders. ``metadata``
    (e.g. how it was trained) goes into ``config.json`` under ``"jspec"``. Written atomically."""
    config, c = head.config, head.config.layer
    tensors = {"fc.weight": head.fc.T, "midlayer.hidden_norm.weight": head.hidden_norm, "norm.weight": head.norm,
               "lm_head.weight": head.lm_head.T} | layer_arrays(head.layer, c, "midlayer.")
    if head.d2t is not None:
        hot = np.arange(config.draft_vocab_size) + np.asarray(head.d2t)
        tensors["d2t"] = np.asarray(head.d2t, np.int64)
        tensors["t2d"] = np.isin(np.arange(c.vocab_size), hot)
    if head.fc_bias is not None:
        tensors["fc.bias"] = head.fc_bias
    if head.embed is not None:
        tensors["embed_tokens.weight"] = head.embed
    if head.fc_norm is not None:
        tensors |= {f"fc_norm.{i}.weight": w for i, w in enumerate(head.fc_norm)}
    hf = dict(
        architectures=[ARCHITECTURES[0]], model_type="llama", num_hidden_layers=1, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, vocab_size=c.vocab_size, draft_vocab_size=config.draft_vocab_size,
        target_hidden_size=config.target_hidden_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False, hidden_act="silu",
        fc_norm=head.fc_norm is not None, torch_dtype=np.dtype(head.fc.dtype).name,
    )
    if c.rope_scaling is not None:
        hf["rope_scaling"] = dict(rope_type="llama3", **dataclasses.asdict(c.rope_scaling))
    if config.aux_layers is not None:
        hf["aux_layers_hf_index"] = list(config.aux_layers)
    write_hf_directory(path, hf, tensors, metadata=metadata)
