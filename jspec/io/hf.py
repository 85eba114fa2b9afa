"""HF checkpoint directories (``config.json`` + safetensors) -> a target ``Model`` (a GGUF file
goes to ``jspec.io.gguf``).

The architecture in ``config.json`` picks the family; the family's ``weights`` module names
and shapes the tensors and builds the model. The whole checkpoint is checked against the
config before any tensor data is read: a missing, unexpected or mis-shaped tensor raises
``ValueError`` naming it. Drafter heads load through their own door (``Eagle3.load``,
``MTP.load``), which reads files through ``jspec.io.safetensors`` as well.
"""

from __future__ import annotations

from pathlib import Path

from jspec.io import hf_quantized
from jspec.io.gguf import is_gguf_file, load_gguf
from jspec.io.safetensors import TensorReader, check_tensors, checkpoint_dtype, read_json, tensor_files
from jspec.models import AnyModel, gemma4, llama
from jspec.models.gemma4 import weights as gemma4_weights
from jspec.models.llama import weights as llama_weights

# (recognises an HF config dict, the family's config builder, the family's weights module);
# the last family is the fallback whose config builder names the unsupported architecture.
_FAMILIES: tuple[tuple, ...] = (
    (gemma4.is_gemma4_config, gemma4.from_hf_config, gemma4_weights),
    (llama.is_llama_config, llama.from_hf_config, llama_weights),
)


def _family(cfg: dict) -> tuple:
    for recognises, from_hf_config, weights in _FAMILIES:
        if recognises(cfg):
            return from_hf_config, weights
    return _FAMILIES[-1][1:]


def config_from_hf(cfg: dict):
    """The family config of an HF ``config.json`` dict (``ValueError`` when unsupported)."""
    from_hf_config, _ = _family(cfg)
    return from_hf_config(cfg)


def load_hf(path, *, dtype=None, quantized: bool = False, progress: bool = False) -> AnyModel:
    """Load an HF Llama 3 / Qwen2 / Qwen3 or Gemma 4 checkpoint directory into a ``Model``
    (``jspec.models.gemma4.Model`` for ``Gemma4ForCausalLM`` / ``Gemma4ForConditionalGeneration``).

    MTP tensors stored in a target checkpoint are skipped, as transformers does
    (``jspec.drafters.MTP.load`` reads them).

    Args:
      path: directory with ``config.json`` and one or more ``*.safetensors`` files (with or
        without ``model.safetensors.index.json``), or a ``.gguf`` file (``jspec.io.load_gguf``).
      dtype: parameter dtype (e.g. ``jnp.bfloat16``); ``None`` keeps the checkpoint's dtype
        (float32 for a GGUF; the embedding's for a quantized checkpoint).
      quantized: for a Llama / Qwen checkpoint quantized by another tool (``quantization_config``:
        FP8, AWQ or GPTQ int4, ``jspec.io.hf_quantized``), keep its quantized linears packed as
        ``jspec.quant.QuantizedWeight`` (scales in ``dtype``); False dequantizes them to ``dtype``.
        For a GGUF file as ``load_gguf``.
      progress: show a progress bar over layers.

    Raises ``ValueError`` for an unsupported architecture or quantization method (naming it), a
    missing, unexpected or mis-shaped tensor, and ``quantized`` with an unquantized checkpoint,
    before any tensor data is read.
    """
    path = Path(path)
    if is_gguf(path):
        return load_gguf(path, dtype=dtype, quantized=quantized, progress=progress)
    cfg = read_json(path / "config.json")
    fmt = hf_quantized.parse(cfg)
    if quantized and fmt is None:
        raise ValueError(f"quantized=True keeps a checkpoint's own quantization; {path} has no quantization_config: "
                         "load it, then jspec.quantize(model, scheme)")
    from_hf_config, weights = _family(cfg)
    if fmt is not None:
        if weights is not llama_weights:
            raise ValueError(f"quantized HF checkpoints ({fmt.method}) are read for Llama / Qwen2 / Qwen3, not "
                             f"{cfg.get('architectures')}")
        cfg = {key: value for key, value in cfg.items() if key != "quantization_config"}  # read: fmt
    config = from_hf_config(cfg)
    files = tensor_files(path)
    with TensorReader(files, weights.hf_names(cfg, config, files)) as reader:
        expected = weights.hf_tensors(config)
        if fmt is not None:
            expected = hf_quantized.expected_tensors(fmt, expected, reader)
        check_tensors(reader, reader.names, expected, tied=config.tie_word_embeddings)
        dtype = checkpoint_dtype(reader, "model.embed_tokens.weight", dtype)
        get = reader.getter(dtype)
        if fmt is not None:
            get = hf_quantized.getter(fmt, reader, get, dtype, quantized=quantized)
        return weights.build(get, config, progress=progress)


def is_gguf(path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix or its magic)."""
    path = Path(path)
    return path.suffix == ".gguf" or is_gguf_file(path)
