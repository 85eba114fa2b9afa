"""``gemma4_assistant`` checkpoints (transformers ``Gemma4AssistantForCausalLM``) -> ``Assistant``.

``config.json``: ``model_type: gemma4_assistant``, ``backbone_hidden_size``,
``use_ordered_embeddings``, ``num_centroids``, ``centroid_intermediate_top_k`` and a
``gemma4_text`` ``text_config`` (full-layer geometry as ``global_head_dim`` or, as transformers
5.23 writes it, ``per_layer_config``). Every assistant layer is KV-shared, whatever
``num_kv_shared_layers`` says.

Tensors: ``pre_projection.weight``, ``post_projection.weight``, the text model under
``model.*`` (or ``model.language_model.*``) without K/V projections (skipped if present), the
tied ``model.embed_tokens.weight`` (a stored ``lm_head.weight`` copy is ignored) and, for the
centroid head, ``masked_embedding.{centroids.weight, token_ordering}``. The head is the
centroid head when ``use_ordered_embeddings`` is set *and* its tensors are there: some
assistants declare centroids but ship only the tied head.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jspec.drafters.frozen_kv_mtp.assistant import Assistant, AssistantConfig
from jspec.io.safetensors import TensorReader, check_tensors, checkpoint_dtype, read_json, tensor_files
from jspec.models import gemma4
from jspec.models.gemma4 import weights as gemma4_weights

ARCHITECTURE = "Gemma4AssistantForCausalLM"
_CENTROID_TENSORS = ("masked_embedding.centroids.weight", "masked_embedding.token_ordering")
_MULTIMODAL_PREFIX = "model.language_model."


def is_assistant_config(cfg: dict) -> bool:
    return cfg.get("model_type") == "gemma4_assistant" or ARCHITECTURE in (cfg.get("architectures") or [])


def config_from_hf(cfg: dict, *, centroid_head: bool) -> AssistantConfig:
    """The ``AssistantConfig`` of a ``gemma4_assistant`` config.json dict; ``centroid_head``:
    whether the checkpoint has the centroid head (see the module docstring)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("gemma4_assistant config.json is missing the field 'text_config'")
    for name in ("num_hidden_layers", "hidden_size"):
        if name not in text:
            raise ValueError(f"gemma4_assistant config.json is missing the field 'text_config.{name}'")
    if "backbone_hidden_size" not in cfg:
        raise ValueError("gemma4_assistant config.json is missing the field 'backbone_hidden_size'")
    # transformers' Gemma4AssistantConfig.validate_architecture (its text-config defaults: 256, false).
    if text.get("hidden_size_per_layer_input", 256) or text.get("use_double_wide_mlp", False):
        raise ValueError(
            "unsupported gemma4_assistant text_config: hidden_size_per_layer_input must be 0 and "
            "use_double_wide_mlp false (an assistant has neither)"
        )
    # transformers makes every layer KV-shared (Gemma4AssistantConfig.__post_init__).
    text = dict(text, num_kv_shared_layers=text["num_hidden_layers"], architectures=None, model_type="gemma4_text")
    return AssistantConfig(
        text=gemma4.from_hf_config(text),
        backbone_hidden_size=int(cfg["backbone_hidden_size"]),
        num_centroids=int(cfg.get("num_centroids", 2048)) if centroid_head else None,
        centroid_top_k=int(cfg.get("centroid_intermediate_top_k", 32)),
    )


def _canonical(name: str) -> str:
    return "model." + name[len(_MULTIMODAL_PREFIX) :] if name.startswith(_MULTIMODAL_PREFIX) else name


def load_assistant(path, *, dtype=None) -> Assistant:
    """Load a ``gemma4_assistant`` checkpoint directory; ``dtype`` casts the weights (None keeps
    the stored dtype). Raises ``ValueError`` naming a missing, unexpected or mis-shaped tensor."""
    path = Path(path)
    cfg = read_json(path / "config.json")
    if not is_assistant_config(cfg):
        raise ValueError(
            f"{path} is not a Gemma 4 assistant (model_type {cfg.get('model_type')!r}, architectures "
            f"{cfg.get('architectures')!r}; expected model_type 'gemma4_assistant')"
        )
    files = tensor_files(path)
    disk = {_canonical(n): n for n in files}
    present = [n for n in _CENTROID_TENSORS if n in disk]
    if cfg.get("use_ordered_embeddings") and len(present) == 1:
        missing = next(n for n in _CENTROID_TENSORS if n not in disk)
        raise ValueError(f"checkpoint is missing tensor(s) ['{missing}'] (use_ordered_embeddings: the centroid head)")
    centroid_head = bool(cfg.get("use_ordered_embeddings")) and len(present) == 2
    config = config_from_hf(cfg, centroid_head=centroid_head)
    text, H_a, H_b = config.text, config.hidden_size, config.backbone_hidden_size

    # The text model's names (K/V projections of its KV-shared layers dropped), then the rest.
    names = gemma4_weights.hf_names({}, text, [n for n in disk if n.startswith("model.")])
    names = {n: disk[n] for n in names}
    names |= {n: d for n, d in disk.items() if not n.startswith("model.")}
    if not centroid_head:
        for n in present:  # declared off (or half-shipped): transformers builds no centroid head
            names.pop(n)
    expected = gemma4_weights.hf_tensors(text)
    expected |= {"pre_projection.weight": (H_a, 2 * H_b), "post_projection.weight": (H_b, H_a)}
    if centroid_head:
        expected |= {_CENTROID_TENSORS[0]: (config.num_centroids, H_a), _CENTROID_TENSORS[1]: (text.vocab_size,)}
    with TensorReader(files, names) as reader:
        check_tensors(reader, reader.names, expected, tied=True)
        get = reader.getter(checkpoint_dtype(reader, "pre_projection.weight", dtype))
        centroids = token_ordering = None
        if centroid_head:
            centroids = jnp.asarray(get(_CENTROID_TENSORS[0], True))
            order = np.asarray(reader.get(_CENTROID_TENSORS[1]))
            if not np.issubdtype(order.dtype, np.integer) or order.min() < 0 or order.max() >= text.vocab_size:
                raise ValueError(
                    f"tensor '{_CENTROID_TENSORS[1]}' must hold token ids in [0, {text.vocab_size}), "
                    f"got dtype {order.dtype}, range [{order.min()}, {order.max()}]"
                )
            token_ordering = jnp.asarray(order.astype(np.int32).reshape(config.num_centroids, -1))
        return Assistant(
            pre_projection=jnp.asarray(get("pre_projection.weight", True)),
            model=gemma4_weights.build(get, text),
            post_projection=jnp.asarray(get("post_projection.weight", True)),
            centroids=centroids,
            token_ordering=token_ordering,
            config=config,
        )
