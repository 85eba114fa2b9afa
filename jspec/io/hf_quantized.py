"""HF checkpoints quantized by other tools (FP8, AWQ, GPTQ) -> :class:`jspec.quant.QuantizedWeight`
kept packed, or dequantized arrays.

``config.json``'s ``quantization_config`` names the method; every linear layer whose format tensors
the checkpoint holds is read from them (the others, and the embedding, as floats). Stored layouts
(PyTorch's ``[N, K]`` = ``[out, in]``) and the value each defines:

* ``"fp8"`` (transformers' fine-grained FP8) and ``"compressed-tensors"`` with 8-bit float
  weights (``format`` ``"float-quantized"`` / ``"naive-quantized"``): ``weight`` float8_e4m3fn
  ``[N, K]`` and a scale grid ``weight_scale_inv`` (fp8) / ``weight_scale`` (compressed-tensors):
  ``[N / bn, K / bk]`` blocks, ``[N, 1]`` per output channel or one value per tensor;
  ``w = fp8 * scale``. Kept as fp8 with K-groups of ``bk`` (a block's scale repeated over its
  ``bn`` channels). An ``input_scale`` (a static activation scale) is not used: jspec quantizes
  weights only, activations stay in the model's dtype.
* ``"awq"`` (AutoAWQ, ``version`` ``"gemm"``, with zero points): ``qweight`` int32 ``[K, N / 8]``
  and ``qzeros`` int32 ``[K / g, N / 8]``, eight 4-bit codes a word along N, nibble ``i`` (bits
  ``4i..4i+3``) holding channel ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``scales`` ``[K / g, N]``;
  ``w = scale * (q - zero)``.
* ``"gptq"`` (AutoGPTQ / GPTQModel, 4 bits): ``qweight`` int32 ``[K / 8, N]``, nibble ``i`` of word
  ``r`` holding row ``8r + i``; ``qzeros`` int32 ``[K / g, N / 8]``, nibble ``j`` channel ``8c + j``;
  ``scales`` ``[K / g, N]``; ``g_idx`` ``[K]``; ``w = scale * (q - zero)`` with ``zero`` the stored
  value plus one in ``checkpoint_format`` ``"gptq"`` (v1, the default: its packer stored
  ``zero - 1``, so a stored 15 reads as 16, as AutoGPTQ's kernels read it) and as stored in
  ``"gptq_v2"``; ``sym`` is not needed (symmetric checkpoints store zeros of 8). Only the trivial
  group order ``g_idx[k] = k // g`` is read (act-order checkpoints permute K: refused).

4-bit weights become int4 with mins, ``scale * c + min`` with ``min = -scale * zero`` (symmetric
int4 when every zero is 8): exact in float32, since a 16-bit-float scale times a 4-bit integer is
exact there; scales and mins in a 16-bit ``dtype`` are rounded to it (the checkpoint's dtype is
the embedding's; fp8 scales likewise). Group sizes must divide K (GPTQ's ``group_size`` -1: one
group of all of K).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from jspec.io import gguf_packed
from jspec.io.layout import Getter, array_source, assemble
from jspec.quant import QuantizedWeight
from pallas_kernels.matmul.quantized_matmul import INT4_OFFSET

METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i of an AWQ word holds channel AWQ_ORDER[i]
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


@dataclasses.dataclass(frozen=True)
class Format:
    """What ``quantization_config`` says about the stored tensors."""

    method: str  # "fp8" (both fp8 methods), "awq" or "gptq"
    group_size: int | None = None  # awq / gptq: K entries per scale; None: all of K (gptq's -1)
    zero_offset: int = 0  # gptq v1: the stored zero is one less than the zero
    scale_name: str = "weight_scale_inv"  # fp8: the scale grid's tensor

    def packed(self, base: str, names) -> bool:
        """Whether the linear ``base`` (its name without ``.weight``) is stored in this format."""
        return f"{base}.{'qweight' if self.method != 'fp8' else self.scale_name}" in names


def parse(cfg: dict) -> Format | None:
    """The :class:`Format` of an HF ``config.json`` dict, None without ``quantization_config``;
    ``ValueError`` naming a method or setting jspec does not read."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported: jspec reads {METHODS}")
    if method == "fp8":
        return Format("fp8")
    if method == "compressed-tensors":
        groups = (q.get("config_groups") or {}).values()
        weights = [g.get("weights") or {} for g in groups]
        formats = {f for f in [q.get("format"), *(g.get("format") for g in groups)] if f is not None}
        if not formats <= {"float-quantized", "naive-quantized"} or not weights or any(
                w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
            raise ValueError(f"compressed-tensors checkpoints are read with 8-bit float weights only (format "
                             f"'float-quantized'); this one has format {sorted(formats)} and weights {weights}")
        return Format("fp8", scale_name="weight_scale")
    if int(q.get("bits", 4)) != 4:
        raise ValueError(f"{method} checkpoints are read with 4-bit weights only, got bits={q.get('bits')}")
    group = int(q.get("group_size", 128))
    if group < 1 and group != -1:
        raise ValueError(f"{method} group_size {group} is not supported (a positive size, or -1: all of K)")
    group = None if group == -1 else group
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or not q.get("zero_point", True):
            raise ValueError(f"awq checkpoints are read in version 'gemm' with zero points only, got version "
                             f"{version!r}, zero_point={q.get('zero_point')}")
        return Format("awq", group)
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (expected 'gptq' or 'gptq_v2')")
    return Format("gptq", group, zero_offset=1 if fmt == "gptq" else 0)


def expected_tensors(fmt: Format, expected: dict[str, tuple], reader) -> dict[str, tuple]:
    """``expected`` (HF name -> float shape) with every linear the checkpoint stores in ``fmt``
    replaced by the format's tensors and their shapes (an fp8 scale grid and ``g_idx`` as stored:
    checked when read)."""
    names = reader.names
    out = {}
    for name, shape in expected.items():
        base = name.removesuffix(".weight")
        if len(shape) != 2 or name == "model.embed_tokens.weight" or not fmt.packed(base, names):
            out[name] = shape
            continue
        n, k = shape
        if fmt.method == "fp8":
            extra = [s for s in (f"{base}.{fmt.scale_name}", f"{base}.input_scale") if s in names]
            out |= {name: shape} | {s: reader.shape(s) for s in extra}
            continue
        g = fmt.group_size or k
        if k % g or n % 8 or k % 8:
            raise ValueError(f"{base}: {fmt.method} group size {g} does not divide K = {k}, or N = {n} / K is not a "
                             "multiple of 8")
        qweight = (k, n // 8) if fmt.method == "awq" else (k // 8, n)
        out |= {f"{base}.qweight": qweight, f"{base}.qzeros": (k // g, n // 8), f"{base}.scales": (k // g, n)}
        if f"{base}.g_idx" in names:
            out[f"{base}.g_idx"] = (k,)
    return out


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 ``[..., W]`` -> uint8 ``[..., W, 8]``: nibble ``i`` at bits ``4i..4i+3``."""
    return ((words.astype(np.uint32)[..., None] >> _SHIFTS) & 0xF).astype(np.uint8)


def _int4_codes(fmt: Format, reader, base: str) -> gguf_packed.Codes:
    """An AWQ / GPTQ linear as :class:`gguf_packed.Codes` ``[N, K]`` (module docstring); ``reader``:
    a ``jspec.io.safetensors.TensorReader``."""
    qweight, qzeros = reader.get(f"{base}.qweight"), reader.get(f"{base}.qzeros")
    scales = reader.get(f"{base}.scales").astype(np.float32)  # [K / g, N]
    groups, n = scales.shape
    zeros = _nibbles(qzeros)  # [K / g, N / 8, 8]
    if fmt.method == "awq":
        q = _nibbles(qweight)[..., np.argsort(AWQ_ORDER)].reshape(qweight.shape[0], n)  # [K, N]
        zeros = zeros[..., np.argsort(AWQ_ORDER)]
    else:
        q = _nibbles(qweight).transpose(0, 2, 1).reshape(-1, n)  # [K, N]: word r's nibble i is row 8r + i
        k = q.shape[0]
        g_idx = reader.get(f"{base}.g_idx") if f"{base}.g_idx" in reader.names else None
        if g_idx is not None and not np.array_equal(g_idx, np.arange(k) // (k // groups)):
            raise ValueError(f"{base}.g_idx is not the trivial group order k // {k // groups}: act-order (desc_act) "
                             "GPTQ checkpoints are not supported")
    zeros = zeros.reshape(groups, n).astype(np.int32) + fmt.zero_offset  # [K / g, N]
    if np.all(zeros == INT4_OFFSET):  # symmetric: w = scale * (q - 8)
        return gguf_packed.Codes(q.T.astype(np.int8) - INT4_OFFSET, scales.T.copy(), None, 4)
    return gguf_packed.Codes(q.T.astype(np.int8), scales.T.copy(), (-scales * zeros).T.copy(), 4)


def _fp8_parts(fmt: Format, reader, base: str) -> tuple[np.ndarray, np.ndarray]:
    """An fp8 linear as ``(values float8_e4m3fn [N, K], scales float32 [N, K / bk])``."""
    values = reader.get(f"{base}.weight")
    if values.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"{base}.weight is {values.dtype}, expected float8_e4m3fn beside its {fmt.scale_name}")
    n, k = values.shape
    grid = np.asarray(reader.get(f"{base}.{fmt.scale_name}"), np.float32)
    grid = grid.reshape(1, 1) if grid.size == 1 else grid.reshape(grid.shape[0], -1)  # per tensor: one block
    block_n, block_k = -(-n // grid.shape[0]), -(-k // grid.shape[1])
    if k % block_k or -(-n // block_n) != grid.shape[0]:
        raise ValueError(f"{base}.{fmt.scale_name} {grid.shape} is no block grid of a weight {(n, k)} whose blocks "
                         "divide K")
    return values, np.repeat(grid, block_n, axis=0)[:n]


def dequantized(fmt: Format, reader, base: str) -> np.ndarray:
    """The float32 ``[N, K]`` the stored linear ``base`` stands for."""
    if fmt.method == "fp8":
        values, scales = _fp8_parts(fmt, reader, base)
        return values.astype(np.float32) * np.repeat(scales, values.shape[1] // scales.shape[1], axis=1)
    codes = _int4_codes(fmt, reader, base)
    per_entry = lambda a: np.repeat(a, codes.group, axis=1)  # noqa: E731
    w = codes.q.astype(np.float32) * per_entry(codes.scales)
    return w if codes.mins is None else w + per_entry(codes.mins)


def _pack_fp8(parts: list[tuple[np.ndarray, np.ndarray]], *, dtype) -> QuantizedWeight:
    """fp8 parts stacked along N, on their finest K-grouping, as a ``QuantizedWeight`` stored ``[N, K]``."""
    import jax  # noqa: PLC0415 (the device transfer only)

    k = parts[0][0].shape[1]
    groups = max(s.shape[1] for _, s in parts)
    if any(groups % s.shape[1] for _, s in parts):
        raise ValueError(f"fused fp8 weights with block grids that do not nest along K = {k}")
    values = np.concatenate([v for v, _ in parts])  # [N, K]
    scales = np.concatenate([np.repeat(s, groups // s.shape[1], axis=1) for _, s in parts]).astype(dtype)
    return QuantizedWeight(jax.device_put(values), jax.device_put(scales), None, transposed=True)


def getter(fmt: Format, reader, plain: Getter, dtype, *, quantized: bool) -> Getter:
    """``plain`` (``jspec.io.layout.getter``'s contract) with the linears stored in ``fmt`` read from
    their format: with ``quantized``, a fused weight whose parts are all stored so is one packed
    ``QuantizedWeight`` stored as the checkpoint stores it, ``[N, K]`` (a matmul weight or a table);
    otherwise, or with float parts beside them, their dequantized values as arrays of ``dtype``."""
    def get(names, transpose=False):
        names = (names,) if isinstance(names, str) else tuple(names)
        bases = [n.removesuffix(".weight") for n in names]
        packed = [n.endswith(".weight") and fmt.packed(b, reader.names) for n, b in zip(names, bases)]
        if not any(packed):
            return plain(names, transpose)
        if quantized and all(packed):
            if fmt.method == "fp8":
                return _pack_fp8([_fp8_parts(fmt, reader, b) for b in bases], dtype=dtype)
            codes = gguf_packed.join([_int4_codes(fmt, reader, b) for b in bases])
            return gguf_packed.pack(codes, dtype=dtype)
        sources = [array_source(dequantized(fmt, reader, b) if p else reader.get(n).astype(np.float32))
                   for n, b, p in zip(names, bases, packed)]
        return assemble(sources, transpose=transpose, dtype=dtype)

    return get
