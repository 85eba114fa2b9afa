"""HF checkpoints quantized by other tools (``jspec.io.hf_quantized``): tiny Llama checkpoints
quantized here with numpy in each format's stored layout (FP8 fine-grained and compressed-tensors,
AWQ, GPTQ v1 / v2), loaded packed (``quantized=True``) and dequantized; both equal the model whose
weights are the format's own dequantization, written below from the formats' definitions, not
from jspec's reader, and fine-grained FP8 computes transformers' logits. Unsupported methods and
act-order GPTQ are named before any compute."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import jspec
from jspec.models.llama.config import to_hf_config
from jspec.models.llama.weights import layer_arrays
from jspec.quant import QuantizedWeight, dequantize
from tests import hf_oracle
from tests.tiny import tiny_model

GROUP = 32  # the tiny model's K (64, 96) are no multiple of the usual 128
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: nibble i of a word holds channel AWQ_ORDER[i]
FP8_MAX = 448.0


def _hf_tensors(model) -> dict[str, np.ndarray]:
    c = model.config
    out = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.final_norm,
           "lm_head.weight": model.lm_head.T}
    for i, layer in enumerate(model.layers):
        out |= layer_arrays(layer, c, f"model.layers.{i}.")
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in out.items()}


def _is_linear(name: str) -> bool:
    return name.endswith("_proj.weight")  # lm_head stays float, as AWQ / GPTQ / llm-compressor leave it


# --- the formats: quantize (the tools' layout) and dequantize (the formats' definitions) ---------------


def _fp8(w, per: str):
    """``(weight fp8 [N, K], scale)`` with the scale per channel ``[N, 1]``, per tensor ``[1]`` or per
    32 x 32 block ``[N / 32, K / 32]``."""
    n, k = w.shape
    if per == "block":
        blocks = np.abs(w).reshape(n // 32, 32, k // 32, 32).max(axis=(1, 3))
        scale = (blocks / FP8_MAX).astype(np.float32)
        full = np.repeat(np.repeat(scale, 32, 0), 32, 1)
    else:
        scale = (np.abs(w).max(axis=1, keepdims=True) if per == "channel" else np.abs(w).max().reshape(1)) / FP8_MAX
        scale = scale.astype(np.float32)
        full = scale.reshape(-1, 1) if per == "channel" else scale
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


def _fp8_value(weight, scale):
    n, k = weight.shape
    if scale.ndim == 2 and scale.shape != (n, 1):  # a block grid: each scale over its 32 x 32 block
        scale = np.repeat(np.repeat(scale, n // scale.shape[0], 0), k // scale.shape[1], 1)
    return weight.astype(np.float32) * scale  # a channel's [N, 1] or the tensor's [1] broadcasts


def _int4(w, sym=False, group=GROUP):
    """4-bit codes per group of K: ``(q [N, K], zeros [N, K / g], scales fp16 [N, K / g])``; asymmetric
    zeros in 1..15 (GPTQ v1 stores zero - 1), symmetric ones all 8."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scales = ((np.maximum(hi, -lo) / 7.5 if sym else (hi - lo) / 15)).astype(np.float16)
    s = scales.astype(np.float32)
    zeros = np.full(lo.shape, 8, np.int32) if sym else np.clip(np.round(-lo / s), 1, 15).astype(np.int32)
    q = np.clip(np.round(g / s[..., None]) + zeros[..., None], 0, 15).astype(np.int32)
    return q.reshape(n, k), zeros, scales


def _words(nibbles):
    """``[..., 8]`` 4-bit values -> int32 ``[...]``, nibble i at bits 4i."""
    words = (nibbles.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return np.ascontiguousarray(words).view(np.int32)  # save_file writes the buffer as it lies, strides ignored


def _unpack(words):
    return (words.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF


def _awq(q, zeros, scales):
    n, k = q.shape
    qweight = _words(q.T.reshape(k, n // 8, 8)[..., AWQ_ORDER])  # [K, N / 8]
    qzeros = _words(zeros.T.reshape(k // GROUP, n // 8, 8)[..., AWQ_ORDER])
    return {"qweight": qweight, "qzeros": qzeros, "scales": np.ascontiguousarray(scales.T)}


def _awq_value(t):
    reverse = np.argsort(AWQ_ORDER)  # AutoAWQ's unpack: [0, 4, 1, 5, 2, 6, 3, 7]
    iq = _unpack(t["qweight"])[..., reverse].reshape(t["qweight"].shape[0], -1)  # [K, N]
    iz = _unpack(t["qzeros"])[..., reverse].reshape(t["qzeros"].shape[0], -1)
    s = t["scales"].astype(np.float32)
    return ((iq.astype(np.float32) - np.repeat(iz, GROUP, 0)) * np.repeat(s, GROUP, 0)).T


def _gptq(q, zeros, scales, v1: bool):
    n, k = q.shape
    group = k // scales.shape[1]
    qweight = _words(q.T.reshape(k // 8, 8, n).transpose(0, 2, 1))  # [K / 8, N]: word r, nibble i = row 8r + i
    stored = (zeros - v1).T.reshape(k // group, n // 8, 8)
    return {"qweight": qweight, "qzeros": _words(stored), "scales": np.ascontiguousarray(scales.T),
            "g_idx": (np.arange(k) // group).astype(np.int32)}


def _gptq_value(t, v1: bool):
    iq = _unpack(t["qweight"]).transpose(0, 2, 1).reshape(-1, t["qweight"].shape[1])  # [K, N]
    iz = _unpack(t["qzeros"]).reshape(t["qzeros"].shape[0], -1) + v1
    s = t["scales"].astype(np.float32)
    group = iq.shape[0] // s.shape[0]
    return ((iq.astype(np.float32) - np.repeat(iz, group, 0)) * np.repeat(s, group, 0)).T


def _ct_config(strategy):
    weights = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    return dict(quant_method="compressed-tensors", format="float-quantized", ignore=["lm_head"],
                config_groups={"group_0": dict(targets=["Linear"], weights=weights,
                                               input_activations=dict(num_bits=8, type="float", strategy="tensor"))})


# name -> (quantization_config, fn(name, w [N, K]) -> (stored tensors, the value they define [N, K]))
def _fp8_case(per, scale_name, input_scale=False):
    def fn(name, w):
        weight, scale = _fp8(w, per)
        base = name.removesuffix(".weight")
        stored = {name: weight, f"{base}.{scale_name}": scale}
        if input_scale:
            stored[f"{base}.input_scale"] = np.ones(1, np.float32)
        return stored, _fp8_value(weight, scale)
    return fn


def _int4_case(method, v1=False, sym=False, per_channel=False):
    def fn(name, w):
        base = name.removesuffix(".weight")
        t = _awq(*_int4(w)) if method == "awq" else _gptq(*_int4(w, sym, w.shape[1] if per_channel else GROUP), v1=v1)
        return {f"{base}.{k}": v for k, v in t.items()}, _awq_value(t) if method == "awq" else _gptq_value(t, v1)
    return fn


CASES = {
    "fp8-channel": (dict(quant_method="fp8", activation_scheme="dynamic"), _fp8_case("channel", "weight_scale_inv")),
    "fp8-block": (dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[32, 32]),
                  _fp8_case("block", "weight_scale_inv")),
    "compressed-tensors-tensor": (_ct_config("tensor"), _fp8_case("tensor", "weight_scale", input_scale=True)),
    "awq": (dict(quant_method="awq", bits=4, group_size=GROUP, zero_point=True, version="gemm"), _int4_case("awq")),
    "gptq-v1": (dict(quant_method="gptq", bits=4, group_size=GROUP, sym=False, desc_act=False),
                _int4_case("gptq", v1=True)),
    "gptq-v2-sym": (dict(quant_method="gptq", bits=4, group_size=GROUP, sym=True, checkpoint_format="gptq_v2"),
                    _int4_case("gptq", sym=True)),
    "gptq-per-channel": (dict(quant_method="gptq", bits=4, group_size=-1, sym=False, checkpoint_format="gptq_v2"),
                         _int4_case("gptq", per_channel=True)),
}


def write_checkpoint(path, model, quantization_config, quantize_fn):
    """The model's HF checkpoint with every linear stored by ``quantize_fn``; returns the float
    checkpoint of the values those tensors define, written beside it."""
    tensors, values = {}, {}
    for name, w in _hf_tensors(model).items():
        stored, value = quantize_fn(name, w) if _is_linear(name) else ({name: w}, w)
        tensors |= stored
        values[name] = np.ascontiguousarray(value, np.float32)
    config = to_hf_config(model.config) | dict(torch_dtype="float32")
    for directory, cfg, data in [(path / "q", config | dict(quantization_config=quantization_config), tensors),
                                 (path / "ref", config, values)]:
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(cfg))
        save_file(data, str(directory / "model.safetensors"))
    return path / "q", path / "ref"


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_loads_packed_and_dequantized_as_its_format_defines(tmp_path, model, case):
    if case == "gptq-v1":  # a Qwen2 (q / k / v biases stay floats beside the packed weights)
        model = tiny_model(0, architecture="Qwen2ForCausalLM", qkv_bias=True)
    q_dir, ref_dir = write_checkpoint(tmp_path, model, *CASES[case])
    reference = jspec.io.load_model(ref_dir)
    packed = jspec.io.load_model(q_dir, quantized=True)
    plain = jspec.io.load_model(q_dir)
    for got, want, flat in zip(packed.layers, reference.layers, plain.layers):
        for field in ("qkv", "o", "gate_up", "down"):
            w = getattr(got, field)
            int4 = case.startswith(("awq", "gptq"))
            assert isinstance(w, QuantizedWeight) and w.scheme.format == ("int4" if int4 else "fp8")
            assert w.scheme.format == "fp8" or w.scheme.mins == (case != "gptq-v2-sym")  # zeros of 8: symmetric
            assert w.transposed  # stored as the checkpoint stores it, [N, K]
            np.testing.assert_array_equal(dequantize(w).T, getattr(want, field))  # exact in float32
            np.testing.assert_array_equal(getattr(flat, field), getattr(want, field))
    assert not isinstance(packed.lm_head, QuantizedWeight) and not isinstance(packed.embed, QuantizedWeight)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    np.testing.assert_allclose(jspec.score(packed, prompts), jspec.score(reference, prompts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization_config, match", [
    (dict(quant_method="bitsandbytes", load_in_4bit=True), "quant_method 'bitsandbytes' is not supported"),
    (dict(quant_method="awq", bits=4, version="gemv"), "version 'gemm'"),
    (dict(quant_method="gptq", bits=8), "4-bit weights only"),
    (dict(_ct_config("channel"), format="pack-quantized"), "8-bit float weights only"),
])
def test_an_unsupported_method_is_named_before_any_tensor_is_read(tmp_path, quantization_config, match):
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(tiny_model(0).config) |
                                                     dict(quantization_config=quantization_config)))
    with pytest.raises(ValueError, match=match):  # no safetensors file there: nothing is read first
        jspec.io.load_model(tmp_path, quantized=True)


def test_act_order_gptq_is_refused_and_quantized_needs_a_quantized_checkpoint(tmp_path, model):
    config, fn = CASES["gptq-v1"]

    def act_order(name, w):
        stored, value = fn(name, w)
        stored = {k: v[::-1].copy() if k.endswith("g_idx") else v for k, v in stored.items()}  # a permuted order
        return stored, value

    q_dir, ref_dir = write_checkpoint(tmp_path, model, dict(config, desc_act=True), act_order)
    with pytest.raises(ValueError, match="g_idx is not the trivial group order .* act-order"):
        jspec.io.load_model(q_dir, quantized=True)
    with pytest.raises(ValueError, match="has no quantization_config"):
        jspec.io.load_model(ref_dir, quantized=True)


def test_fine_grained_fp8_matches_transformers(tmp_path, model):
    """transformers reads a fine-grained FP8 checkpoint on a CPU by dequantizing it (in float32 here);
    jspec keeps it packed and computes the same logits. (compressed-tensors, AWQ and GPTQ need
    packages the reference environment lacks: compressed-tensors, gptqmodel, optimum; those formats
    are checked against their definitions above.)"""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    (tmp_path / "tokens.json").write_text(json.dumps(prompts))
    dirs = {case: write_checkpoint(tmp_path / case, model, *CASES[case])[0] for case in ("fp8-channel", "fp8-block")}
    hf_oracle.run("logits", str(tmp_path / "tokens.json"), *map(str, dirs.values()))
    for q_dir in dirs.values():
        ours = jspec.score(jspec.io.load_model(q_dir, quantized=True), prompts)
        np.testing.assert_allclose(ours, np.load(q_dir / "transformers_logits.npy"), rtol=1e-5, atol=5e-5)
