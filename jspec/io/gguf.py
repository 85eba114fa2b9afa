"""GGUF files (llama.cpp's checkpoint format) -> a target ``Model``.

The file is read with the ``gguf`` package (llama.cpp's own reader and dequantizers). The
config comes from the file's metadata (``{arch}.*`` keys), tensor names map to the family's HF
layout through gguf's own name table, and the whole file is checked (architecture, tensor
names, shapes, quantization types) before any tensor is dequantized. llama.cpp's converter
permutes the rows of Llama's q/k projections within each head; they are put back exactly as
transformers' GGUF loader does. Tensors are dequantized in row blocks straight into the
target dtype and layout (``jspec.io.layout``), or, with ``quantized=True``, each matmul weight and
the embedding table kept in its own GGUF type as a ``QuantizedWeight`` (``jspec.io.gguf_packed``).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from jspec.io import gguf_packed
from jspec.io.layout import Getter, RowSource, array_source, getter
from jspec.io.safetensors import check_tensors
from jspec.models import llama
from jspec.models.llama import weights as llama_weights

GGUF_MAGIC = b"GGUF"
# GGUF ``general.architecture`` -> the HF architecture jspec builds.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Architectures whose q/k rows llama.cpp's converter permutes (transformers' LlamaTensorProcessor).
_PERMUTED_QK = frozenset({"llama"})
# Tensor types gguf's numpy dequantizers read.
DEQUANTIZABLE = frozenset(
    "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K TQ1_0 TQ2_0 "
    "IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS".split()
)
_MISSING = object()


def is_gguf_file(path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


class _Reader(gguf.GGUFReader):
    """``gguf.GGUFReader``, parsing the header several times faster: it slices the file once per
    value (~250k times for a 150k-token vocabulary), and slicing its ``np.memmap`` runs memmap's
    Python-level ``__getitem__`` / ``__array_finalize__`` each time; a plain ndarray view of the
    same mapping does not."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        values = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path) -> gguf.GGUFReader:
    """A ``gguf.GGUFReader`` over ``path``; ``ValueError`` for a missing, foreign, truncated or
    corrupt file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file" if path.exists() else f"{path} not found")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    size = path.stat().st_size
    try:
        reader = _Reader(path)
    except Exception as e:  # the reader indexes past the end of a cut file in many places
        raise ValueError(
            f"{path} is truncated or corrupt ({size} bytes): reading it failed with {type(e).__name__}: {e}"
        ) from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ValueError(f"{path} is truncated: its tensors end at byte {end}, but the file has {size} bytes")
    return reader


def metadata(reader: gguf.GGUFReader, key: str, default=_MISSING):
    """The value of metadata field ``key`` (``default`` when absent, else ``ValueError``)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata is missing the field {key!r}")
        return default
    return field.contents()


def architecture(reader: gguf.GGUFReader) -> str:
    """``general.architecture``, checked against the supported ones."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {sorted(ARCHITECTURES)})")
    return arch


def config_from_gguf(reader: gguf.GGUFReader) -> llama.LlamaConfig:
    """The ``LlamaConfig`` of a Llama / Qwen2 / Qwen3 GGUF, from its metadata; ``ValueError``
    naming the field or tensor for anything jspec does not implement."""
    arch = architecture(reader)

    def field(name, default=_MISSING):
        value = metadata(reader, f"{arch}.{name}", default)
        if value is not default and not isinstance(value, int | float):
            raise ValueError(f"unsupported GGUF field {arch}.{name}={value!r} (expected one number)")
        return value

    if field("expert_count", 0):
        raise ValueError(f"unsupported GGUF field {arch}.expert_count={field('expert_count')} (mixture of experts)")
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"unsupported GGUF field {arch}.rope.scaling.type={scaling!r} (supported: 'none')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("unsupported GGUF tensor 'rope_freqs.weight' (RoPE frequency factors)")
    hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
    # Qwen3 stores head_dim as key_length; Llama as the rotary dimension (transformers reads it so).
    head_dim = field("attention.key_length", None)
    if head_dim is None and arch == "llama":
        head_dim = field("rope.dimension_count", None)
    head_dim = int(head_dim or hidden // heads)
    value_dim = field("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ValueError(f"unsupported GGUF field {arch}.attention.value_length={value_dim} (!= head dim {head_dim})")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = field("vocab_size", None) or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens (the vocabulary size)")
    return llama.from_hf_config(
        dict(
            architectures=[ARCHITECTURES[arch]],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(field("feed_forward_length")),
            num_hidden_layers=int(field("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(field("attention.head_count_kv", heads)),
            head_dim=head_dim,
            max_position_embeddings=int(field("context_length")),
            rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
            rope_theta=float(field("rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in names,  # as transformers decides it
        )
    )


def gguf_names(config: llama.LlamaConfig, arch: str) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, from gguf's own name table."""
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    table = gguf.get_tensor_name_map(arch_id, config.num_layers)
    names = {}
    for hf_name in llama_weights.hf_tensors(config):
        module, suffix = hf_name.rsplit(".", 1)
        names[hf_name] = f"{table.get_name(module)}.{suffix}"
    return names


def _shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantized_rows(tensor, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of a 2-D GGUF tensor as floats (each row holds whole quantization blocks)."""
    return gguf.quants.dequantize(tensor.data[lo:hi], tensor.tensor_type)


def _unpermute_heads(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Whole heads of q/k rows back in HF order: llama.cpp stores the rows of a head as
    ``[head_dim // 2, 2]`` (interleaved rotary pairs) where HF has ``[2, head_dim // 2]``."""
    return rows.reshape(-1, head_dim // 2, 2, rows.shape[-1]).swapaxes(1, 2).reshape(rows.shape)


def _row_source(tensor, head_dim: int | None) -> RowSource:
    shape = _shape(tensor)
    if len(shape) == 1:
        return array_source(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape))
    if head_dim is None:
        return RowSource(shape, lambda lo, hi: _dequantized_rows(tensor, lo, hi))
    return RowSource(
        shape, lambda lo, hi: _unpermute_heads(_dequantized_rows(tensor, lo, hi), head_dim), row_multiple=head_dim
    )


class _Tensors:
    """GGUF tensors by name, with the ``shape(name)`` that ``check_tensors`` asks for."""

    def __init__(self, reader: gguf.GGUFReader):
        self.by_name = {t.name: t for t in reader.tensors}

    def shape(self, name) -> tuple[int, ...]:
        return _shape(self.by_name[name])


def load_gguf(path, *, dtype=None, quantized: bool = False, progress: bool = False) -> llama.Model:
    """Load a Llama / Qwen2 / Qwen3 GGUF file into a ``Model``.

    Args:
      path: the ``.gguf`` file.
      dtype: parameter dtype; ``None`` gives float32 (what every GGUF tensor type dequantizes to
        without loss, and what transformers' GGUF loader produces).
      quantized: keep each matmul weight and the embedding table (the tied LM head) in the file's
        own quantization, as a ``jspec.quant.QuantizedWeight`` that dequantizes exactly to gguf's
        values in float32 (``jspec.io.gguf_packed``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
        Q6_K); its scales and mins are in ``dtype`` (with bfloat16, rounded to it: no longer
        exact). Tensors stored as floats, and fused weights with a part stored as floats, stay
        arrays. False: every tensor dequantized to ``dtype``.
      progress: show a progress bar over layers.

    Raises ``ValueError`` for an unsupported architecture, field or tensor type (with
    ``quantized``, a matrix of a type that cannot be kept packed), a missing, unexpected or
    mis-shaped tensor, and a truncated or corrupt file, before any tensor is read.
    """
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    arch = architecture(reader)
    names = gguf_names(config, arch)
    tensors = _Tensors(reader)
    expected = llama_weights.hf_tensors(config)
    check_tensors(tensors, set(tensors.by_name), {names[n]: shape for n, shape in expected.items()})
    for name in sorted(names.values()):
        kind = tensors.by_name[name].tensor_type.name
        if kind not in DEQUANTIZABLE:
            raise ValueError(
                f"GGUF tensor {name!r} has type {kind}, which jspec cannot dequantize (supported: {sorted(DEQUANTIZABLE)})"
            )
        if quantized and len(tensors.shape(name)) == 2 and kind not in gguf_packed.PACKABLE | gguf_packed.FLOAT_TYPES:
            raise ValueError(
                f"GGUF tensor {name!r} has type {kind}, which jspec cannot keep packed (quantized=True supports "
                f"{sorted(gguf_packed.PACKABLE)} and float tensors): load with quantized=False to dequantize it"
            )

    def permuted_head_dim(hf_name: str) -> int | None:
        if arch in _PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            return config.head_dim
        return None

    def source(hf_name: str) -> RowSource:
        return _row_source(tensors.by_name[names[hf_name]], permuted_head_dim(hf_name))

    dtype = np.float32 if dtype is None else dtype
    get = getter(source, dtype)
    if quantized:
        get = _packed_getter(lambda n: tensors.by_name[names[n]], permuted_head_dim, get, dtype)
    return llama_weights.build(get, config, progress=progress)


def keeps_packed(path) -> bool:
    """Whether ``load_gguf(path, quantized=True)`` loads the GGUF file at ``path`` with some matrix kept
    packed: it holds a matrix of a packable type and none of a type that cannot stay packed."""
    kinds = {t.tensor_type.name for t in open_gguf(path).tensors if len(_shape(t)) == 2}
    return bool(kinds & gguf_packed.PACKABLE) and kinds <= gguf_packed.PACKABLE | gguf_packed.FLOAT_TYPES


def _packed_getter(tensor, permuted_head_dim, plain: Getter, dtype) -> Getter:
    """``plain`` (``jspec.io.layout.getter``'s contract) with matrices of packable types kept packed:
    ``get(names, True)`` a matmul weight ``[in, sum(out)]``, ``get(name)`` of a matrix an embedding
    table ``[vocab, hidden]``. ``tensor(name)``: the GGUF tensor of an HF name;
    ``permuted_head_dim(name)``: the head size whose rows llama.cpp permuted, or None."""

    def get(names, transpose=False):
        names = (names,) if isinstance(names, str) else tuple(names)
        stored = [tensor(n) for n in names]
        if len(_shape(stored[0])) != 2 or any(t.tensor_type.name not in gguf_packed.PACKABLE for t in stored):
            return plain(names, transpose)  # vectors, and weights with floats in them: only exact as arrays
        parts = []
        for name, t in zip(names, stored):
            codes = gguf_packed.decode(t)
            if (head_dim := permuted_head_dim(name)) is not None:
                codes = codes.map_rows(lambda rows, head_dim=head_dim: _unpermute_heads(rows, head_dim))
            parts.append(codes)
        return gguf_packed.pack(gguf_packed.join(parts), dtype=dtype)

    return get
