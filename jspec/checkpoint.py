"""HF safetensors checkpoints -> ``Model``; orbax save / restore of ``Model``.

``load_hf`` checks the whole checkpoint against the config before reading any tensor data:
a missing, unexpected or mis-shaped tensor raises ``ValueError`` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from jspec.config import LlamaConfig, config_from_dict, config_to_dict, llama_config_from_hf
from jspec.gemma4_config import is_gemma4_config
from jspec.models import AnyModel
from jspec.models.llama import Layer, Model

# Buffers some exporters write that carry no parameters.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file, index.json, or all shards)."""
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no 'weight_map'")
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise ValueError(f"{index_path} names the shard {f.name}, which does not exist")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors files in {path}")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="numpy") as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"tensor {name!r} appears in both {files[name].name} and {shard.name}")
                files[name] = shard
    return files


def expected_hf_tensors(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape (PyTorch ``(out, in)`` layout) for this config."""
    H, hd = c.hidden_size, c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (c.q_size, H),
            p + "self_attn.k_proj.weight": (c.kv_size, H),
            p + "self_attn.v_proj.weight": (c.kv_size, H),
            p + "self_attn.o_proj.weight": (H, c.q_size),
            p + "mlp.gate_proj.weight": (c.intermediate_size, H),
            p + "mlp.up_proj.weight": (c.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, c.intermediate_size),
        }
        if c.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (c.q_size,),
                p + "self_attn.k_proj.bias": (c.kv_size,),
                p + "self_attn.v_proj.bias": (c.kv_size,),
            }
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return shapes


class _TensorReader:
    """Reads named tensors from a set of safetensors files, keeping each file open once."""

    def __init__(self, files: dict[str, Path]):
        self._files = files
        self._open = {}

    def _handle(self, name):
        f = self._files[name]
        if f not in self._open:
            self._open[f] = safe_open(f, framework="numpy").__enter__()
        return self._open[f]

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name) -> str:
        return self._handle(name).get_slice(name).get_dtype()

    def get(self, name) -> np.ndarray:
        return self._handle(name).get_tensor(name)

    def close(self):
        for h in self._open.values():
            h.__exit__(None, None, None)
        self._open.clear()


def _check_tensors(reader: _TensorReader, names: set[str], expected: dict[str, tuple[int, ...]], tied: bool):
    names = {n for n in names if not n.endswith(_IGNORABLE_SUFFIXES)}
    if tied:
        names.discard("lm_head.weight")  # some exporters write the tied copy; it is the embedding
    missing = sorted(set(expected) - names)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensor(s) {missing[:5]}{more}")
    unexpected = sorted(names - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(f"checkpoint has unexpected tensor(s) {unexpected[:5]}{more}")
    for name, shape in expected.items():
        actual = reader.shape(name)
        if actual != shape:
            raise ValueError(f"tensor {name!r} has shape {actual}, expected {shape}")


def load_hf(path, *, dtype=None, progress: bool = False) -> Model:
    """Load an HF Llama 3 / Qwen2 / Qwen3 or Gemma 4 checkpoint directory into a ``Model``
    (``jspec.models.gemma4.Model`` for ``Gemma4ForCausalLM`` / ``Gemma4ForConditionalGeneration``).

    An EAGLE-3 head directory (``architectures: ["LlamaForCausalLMEagle3"]``) gives an
    ``Eagle3Head`` for ``jspec.drafters.Eagle3`` instead. MTP tensors stored in a target
    checkpoint are skipped here; ``jspec.load_hf_mtp`` reads them (see ``jspec.drafter_checkpoint``).

    Args:
      path: directory with ``config.json`` and one or more ``*.safetensors`` files (with or
        without ``model.safetensors.index.json``).
      dtype: parameter dtype (e.g. ``jnp.bfloat16``); ``None`` keeps the checkpoint's dtype.
      progress: show a progress bar over layers.
    """
    from jspec import drafter_checkpoint

    path = Path(path)
    cfg = _read_json(path / "config.json")
    if drafter_checkpoint.is_eagle3_config(cfg):
        return drafter_checkpoint.load_eagle3(path, dtype=dtype, cfg=cfg)
    if is_gemma4_config(cfg):
        from jspec import gemma4_checkpoint

        return gemma4_checkpoint.load(path, cfg, dtype=dtype, progress=progress)
    config = llama_config_from_hf(cfg)
    files = _tensor_files(path)
    reader = _TensorReader(files)
    try:
        names = {n for n in files if not drafter_checkpoint.is_mtp_tensor(n, cfg)}
        _check_tensors(reader, names, expected_hf_tensors(config), config.tie_word_embeddings)
        target = np.dtype(dtype) if dtype is not None else np.dtype(reader.get("model.embed_tokens.weight").dtype)

        def get(name, transpose=False):
            x = reader.get(name)
            return (x.T if transpose else x).astype(target)

        def fused(names):
            return jnp.asarray(np.concatenate([get(n, transpose=True) for n in names], axis=-1))

        layers = []
        for i in tqdm(range(config.num_layers), desc="layers", disable=not progress):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            layers.append(
                Layer(
                    attn_norm=jnp.asarray(get(p + "input_layernorm.weight")),
                    qkv=fused(attn),
                    o=jnp.asarray(get(p + "self_attn.o_proj.weight", transpose=True)),
                    mlp_norm=jnp.asarray(get(p + "post_attention_layernorm.weight")),
                    gate_up=fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=jnp.asarray(get(p + "mlp.down_proj.weight", transpose=True)),
                    qkv_bias=(
                        jnp.asarray(np.concatenate([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
                        if config.qkv_bias
                        else None
                    ),
                    q_norm=jnp.asarray(get(p + "self_attn.q_norm.weight")) if config.qk_norm else None,
                    k_norm=jnp.asarray(get(p + "self_attn.k_norm.weight")) if config.qk_norm else None,
                )
            )
        return Model(
            embed=jnp.asarray(get("model.embed_tokens.weight")),
            layers=tuple(layers),
            final_norm=jnp.asarray(get("model.norm.weight")),
            lm_head=None if config.tie_word_embeddings else jnp.asarray(get("lm_head.weight", transpose=True)),
            config=config,
        )
    finally:
        reader.close()


# ---------------------------------------------------------------------------------------
# orbax

_CONFIG_FILE = "jspec_config.json"
_PARAMS_DIR = "params"


def save(model: AnyModel, path, *, overwrite: bool = False) -> None:
    """Write ``model`` to the directory ``path`` (config JSON + orbax parameter checkpoint)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True to replace it)")
    path.mkdir(parents=True, exist_ok=True)
    meta = {"config": config_to_dict(model.config), "dtype": np.dtype(model.dtype).name}
    (path / _CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / _PARAMS_DIR, model, force=True)
        ckptr.wait_until_finished()


def restore(path) -> AnyModel:
    """Read a ``Model`` written by ``save``; the arrays come back bit-exactly."""
    import orbax.checkpoint as ocp

    from jspec.models import init_params

    path = Path(path).absolute()
    meta = _read_json(path / _CONFIG_FILE)
    config = config_from_dict(meta["config"])
    dtype = jnp.dtype(getattr(ml_dtypes, meta["dtype"], meta["dtype"]))
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path / _PARAMS_DIR, abstract)
