"""jspec's GGUF loader reproduces transformers' GGUF loader on tiny Llama / Qwen2 / Qwen3 files
written the way llama.cpp's converter writes them (Llama's q/k rows permuted; F16 and several
quantized types); a bad GGUF is a ValueError naming the problem, raised before any tensor is read."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.io.gguf import DEQUANTIZABLE
from tests import hf_oracle

ROOT = Path(__file__).resolve().parent.parent
CASES = ["gguf-llama", "gguf-qwen2", "gguf-qwen3"]


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """Tiny GGUF files + transformers' outputs on them (tests/hf_reference/gguf_files.py, cmd_gguf)."""
    return hf_oracle.once_per_run(tmp_path_factory, "hf_gguf", lambda out: hf_oracle.make("gguf", out))


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(gguf_models, name):
    model = jspec.load_gguf(gguf_models / name / "model.gguf")
    ref = np.load(gguf_models / name / "reference.npz")
    logits = np.asarray(jspec.score(model, ref["score_ids"]))
    expected = ref["score_logits"]
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4


@pytest.mark.parametrize("name", CASES)
def test_greedy_generate_matches_transformers(gguf_models, name):
    model = jspec.load_gguf(gguf_models / name / "model.gguf")
    spec = json.loads((gguf_models / "prompts.json").read_text())
    expected = np.load(gguf_models / name / "reference.npz")["generated"].tolist()
    assert jspec.generate(model, spec["prompts"], spec["max_new_tokens"]) == expected


def test_config_comes_from_metadata(gguf_models):
    llama = jspec.io.config_from_gguf(jspec.io.open_gguf(gguf_models / "gguf-llama" / "model.gguf"))
    assert (llama.architecture, llama.head_dim, llama.tie_word_embeddings, llama.vocab_size) == (
        "LlamaForCausalLM", 16, False, 160)
    assert (llama.num_heads, llama.num_kv_heads, llama.num_layers, llama.rope_theta) == (4, 2, 3, 10000.0)
    qwen2 = jspec.io.config_from_gguf(jspec.io.open_gguf(gguf_models / "gguf-qwen2" / "model.gguf"))
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and qwen2.vocab_size == 160  # vocab from the token list
    qwen3 = jspec.io.config_from_gguf(jspec.io.open_gguf(gguf_models / "gguf-qwen3" / "model.gguf"))
    assert qwen3.qk_norm and qwen3.head_dim == 128 and not qwen3.tie_word_embeddings


def test_every_front_door_reads_gguf(gguf_models):
    path = gguf_models / "gguf-qwen2" / "model.gguf"
    reference = jax.tree_util.tree_leaves(jspec.load_gguf(path))
    for model in (jspec.load_hf(path), jspec.io.load_hf(path), jspec.io.load_model(path), jspec.io.load_model(str(path))):
        for a, b in zip(jax.tree_util.tree_leaves(model), reference, strict=True):
            np.testing.assert_array_equal(a, b)


def test_dtype_argument_casts_the_dequantized_values(gguf_models):
    path = gguf_models / "gguf-llama" / "model.gguf"
    full, half = jspec.load_gguf(path), jspec.load_gguf(path, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree_util.tree_leaves(full)} == {jnp.dtype(jnp.float32)}
    for a, b in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(half), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_open_gguf_reads_what_the_gguf_reader_reads(gguf_models):
    path = gguf_models / "gguf-qwen2" / "model.gguf"
    fast, stock = jspec.io.open_gguf(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert fast.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, t.data_offset) for t in fast.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors, strict=True):
        np.testing.assert_array_equal(a.data, b.data)


# Byte offsets of each block's fp16 scale fields (negative: from the block's end), after gguf.quants'
# dequantize_blocks. Everything else in a block is a bit field any byte value fills validly
# (quants, 4- and 6-bit sub-scales, signs, grid indices).
FP16_SCALES = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),  # d (and m) first
    "Q2_K": (-4, -2), "Q3_K": (-2,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,),
    "TQ1_0": (-2,), "TQ2_0": (-2,),
    "IQ1_S": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
    "IQ1_M": (),  # its one scale is spread over the top nibbles of the block's last four uint16s
}


def random_blocks(rng, name: str, rows: int, cols: int, scale: float = 2.0) -> np.ndarray:
    """A ``[rows, cols]`` tensor of type ``name`` as GGUF stores it (``[rows, bytes per row]``
    uint8 for a quantized type): random payload bits, random finite fp16 scales in ``[-scale, scale]``."""
    qtype = gguf.GGMLQuantizationType[name]
    if name in ("F32", "F16", "BF16"):
        values = rng.normal(size=(rows, cols)).astype(np.float32)
        if name == "BF16":  # the top half of a float32, as gguf writes it
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, 2 * cols)
        return values.astype(np.float16) if name == "F16" else values
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)
    scales = rng.uniform(-scale, scale, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint16)
    for offset in FP16_SCALES[name]:
        start = offset % type_size
        blocks[:, start:start + 2] = scales.view(np.uint8)
    if name == "IQ1_M":
        tail = blocks[:, -8:].view(np.uint16)  # scale bits 4i..4i+3 are the top nibble of uint16 i
        tail[:] = (tail & 0x0FFF) | (((scales >> (4 * np.arange(4, dtype=np.uint16))) & 0xF) << 12)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", sorted(DEQUANTIZABLE))
def test_every_listed_tensor_type_dequantizes(tmp_path, name):
    """Each type jspec accepts, as random valid blocks in a GGUF file, read through jspec's loader
    path (its reader, the row sources in blocks of rows, the transposed write into the parameter
    buffer) gives exactly what gguf's reference dequantizer gives on the same bytes: in float32,
    and rounded once in bfloat16. 70 rows: two row blocks of the transposed write; two quant
    blocks per row."""
    from jspec.io.gguf import _row_source
    from jspec.io.layout import assemble

    qtype = gguf.GGMLQuantizationType[name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rows, cols = 70, 2 * block
    stored = random_blocks(np.random.default_rng(sorted(DEQUANTIZABLE).index(name)), name, rows, cols)
    expected = gguf.quants.dequantize(stored, qtype)
    assert expected.shape == (rows, cols) and np.isfinite(expected).all()  # valid blocks, finite scales
    assert expected.std() > 0

    writer = gguf.GGUFWriter(str(tmp_path / "one.gguf"), "llama")
    writer.add_tensor("w", stored, raw_dtype=qtype)  # uint8 rows: gguf takes their byte shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = jspec.io.open_gguf(tmp_path / "one.gguf").tensors
    assert tensor.tensor_type == qtype
    source = _row_source(tensor, None)
    assert source.shape == (rows, cols)
    np.testing.assert_array_equal(np.asarray(assemble([source], transpose=True, dtype=np.float32)), expected.T)
    half = assemble([source], transpose=False, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(half), expected.astype(jnp.bfloat16))


def test_tensors_are_written_once_into_their_layout():
    """``jspec.io.layout.assemble``: blocks of rows written transposed, cast and fused into one
    aligned buffer that the CPU device adopts without a copy."""
    from jspec.io.layout import RowSource, array_source, assemble

    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(200, 24)).astype(np.float32), rng.normal(size=(64, 24)).astype(np.float32)
    reads = []

    def read_k(lo, hi):
        reads.append((lo, hi))
        return k[lo:hi]

    fused = assemble([array_source(q), RowSource(k.shape, read_k, row_multiple=48)], transpose=True, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(fused), np.concatenate([q.T, k.T], axis=-1))
    assert all(lo % 48 == 0 and (hi % 48 == 0 or hi == 64) for lo, hi in reads)
    half = assemble([array_source(q)], transpose=False, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(half), q.astype(jnp.bfloat16))
    bias = assemble([array_source(q[0]), array_source(k[0])], transpose=True, dtype=np.float32)  # vectors: concatenated
    np.testing.assert_array_equal(np.asarray(bias), np.concatenate([q[0], k[0]]))
    assert fused.unsafe_buffer_pointer() % 64 == 0


# --- bad files ------------------------------------------------------------------------------


def rewrite(src, dst, *, arch=None, retype=None, drop=(), add_fields=None, add_tensors=None):
    """Copy the GGUF ``src`` to ``dst`` with one thing changed: the architecture (and its key
    prefix), tensor types (``{name: type name}``, zero data), dropped tensors, extra metadata
    (``{key: int}``) or extra F32 tensors (``{name: array}``)."""
    reader = gguf.GGUFReader(src)
    old = reader.fields["general.architecture"].contents()
    arch = arch or old
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key.replace(f"{old}.", f"{arch}.", 1), field.contents(), field.types[0], sub_type=sub_type)
    for key, value in (add_fields or {}).items():
        writer.add_uint32(key, value)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if retype and t.name in retype:
            qtype = gguf.GGMLQuantizationType[retype[t.name]]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype), np.uint8)
            writer.add_tensor(t.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for name, value in (add_tensors or {}).items():
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def llama_gguf(gguf_models):
    return gguf_models / "gguf-llama" / "model.gguf"


def test_rewritten_file_still_loads(llama_gguf, tmp_path):
    """The bad-file tests below change one thing in an otherwise loadable copy."""
    copy = jspec.load_gguf(rewrite(llama_gguf, tmp_path / "copy.gguf"))
    for a, b in zip(jax.tree_util.tree_leaves(copy), jax.tree_util.tree_leaves(jspec.load_gguf(llama_gguf)), strict=True):
        np.testing.assert_array_equal(a, b)


BAD_FILES = {
    "unsupported tensor type": (dict(retype={"blk.1.ffn_down.weight": "Q8_1"}), "'blk.1.ffn_down.weight' has type Q8_1"),
    "unsupported architecture": (dict(arch="mamba"), "unsupported GGUF architecture 'mamba'"),
    "missing tensor": (dict(drop={"blk.2.ffn_up.weight"}), "missing tensor(s) ['blk.2.ffn_up.weight']"),
    "unexpected tensor": (dict(add_tensors={"blk.0.extra.weight": np.ones(4)}), "unexpected tensor(s) ['blk.0.extra.weight']"),
    "mixture of experts": (dict(add_fields={"llama.expert_count": 4}), "llama.expert_count=4"),
    "rope frequency factors": (dict(add_tensors={"rope_freqs.weight": np.ones(8)}), "'rope_freqs.weight'"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_gguf_is_a_value_error_naming_it(llama_gguf, tmp_path, case):
    changes, message = BAD_FILES[case]
    bad = rewrite(llama_gguf, tmp_path / "bad.gguf", **changes)
    with pytest.raises(ValueError) as e:
        jspec.load_gguf(bad)
    assert message in str(e.value)


def test_mis_shaped_tensor_is_named(llama_gguf, tmp_path):
    bad = rewrite(llama_gguf, tmp_path / "bad.gguf", drop={"blk.0.attn_v.weight"},
                  add_tensors={"blk.0.attn_v.weight": np.ones((16, 64))})
    with pytest.raises(ValueError, match=r"'blk.0.attn_v.weight' has shape \(16, 64\), expected \(32, 64\)"):
        jspec.load_gguf(bad)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_gguf_is_a_value_error(llama_gguf, tmp_path, keep):
    data = llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated"):
        jspec.load_gguf(cut)


def test_not_a_gguf_file(tmp_path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        jspec.load_gguf(other)
    with pytest.raises(ValueError, match="not found"):
        jspec.load_gguf(tmp_path / "missing.gguf")


def test_load_hf_tells_gguf_from_directories(llama_gguf, tmp_path):
    assert jspec.io.is_gguf(llama_gguf)
    renamed = tmp_path / "weights.bin"  # the magic decides when the suffix does not
    shutil.copy(llama_gguf, renamed)
    assert jspec.io.is_gguf(renamed)
    assert jspec.load_hf(renamed).config == jspec.load_gguf(llama_gguf).config


# --- scripts/convert_hf.py on a GGUF -----------------------------------------------------------


@pytest.fixture(scope="module")
def convert():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "scripts" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_convert_a_gguf_to_a_jspec_checkpoint(convert, llama_gguf, tmp_path, capsys):
    # The tiny file's vocabulary has no merges: no tokenizer to write, the weights alone.
    convert([str(llama_gguf), str(tmp_path / "ckpt"), "--no-tokenizer"])
    assert "wrote LlamaForCausalLM (3 layers, vocab 160, float32)" in capsys.readouterr().out
    restored = jspec.restore(tmp_path / "ckpt")
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(jspec.load_gguf(llama_gguf)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert jspec.io.load_model(tmp_path / "ckpt").config == restored.config


@pytest.mark.parametrize("case", ["existing destination", "destination is a file", "unknown source"])
def test_convert_bad_command_line_is_one_line(convert, llama_gguf, tmp_path, capsys, case):
    dst = tmp_path / "out"
    src = str(llama_gguf)
    if case == "existing destination":
        dst.mkdir()
        (dst / "something").write_text("x")
        src = "no-such-model"  # the destination is checked first, before any loading
        message = "exists and is not empty (pass --overwrite to replace it)"
    elif case == "destination is a file":
        dst.write_text("x")
        message = "exists and is a file"
    else:
        message = "'no-such-model' is neither a known name"
        src = "no-such-model"
    with pytest.raises(SystemExit) as e:
        convert([src, str(dst)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1
