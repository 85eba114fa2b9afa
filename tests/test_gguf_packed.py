"""GGUF blocks kept packed (``load_gguf(path, quantized=True)``, ``jspec.io.gguf_packed``): each type
dequantizes bit for bit to gguf's own values, a tiny mixed-type model's packed weights to its
dequantized weights, its logits to the dequantized model's, speculation on it is lossless, and a
type that cannot be kept packed is named before anything is read."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import DraftModel, NGram
from jspec.io import gguf_packed
from jspec.quant import QuantizedWeight, dequantize
from tests.test_gguf import random_blocks


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def write_gguf(path, tensors: dict[str, tuple[str, np.ndarray]], fields=None):
    """A GGUF file (architecture llama) holding ``{name: (type name, data as stored)}``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (fields or {}).items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    for name, (kind, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("name", sorted(gguf_packed.PACKABLE))
def test_each_type_dequantizes_bit_for_bit_to_ggufs_values(tmp_path, name):
    """Random valid blocks (every code, sub-scale and high bit drawn) read from a file and packed as
    the file stores them, ``[N, K]``: float32 dequantization equals gguf's reference dequantizer on
    the same bytes bit for bit, signed zeros included."""
    qtype = gguf.GGMLQuantizationType[name]
    rows, cols = 6, 2 * gguf.GGML_QUANT_SIZES[qtype][0]
    stored = random_blocks(np.random.default_rng(sorted(gguf_packed.PACKABLE).index(name)), name, rows, cols)
    expected = gguf.quants.dequantize(stored, qtype)
    (tensor,) = jspec.io.open_gguf(write_gguf(tmp_path / "one.gguf", {"w": (name, stored)})).tensors
    codes = gguf_packed.decode(tensor)
    w = gguf_packed.pack(codes, dtype=jnp.float32)
    assert w.transposed and w.shape == (rows, cols)
    np.testing.assert_array_equal(np.asarray(dequantize(w, jnp.float32)).view(np.uint32), expected.view(np.uint32))


# --- a tiny model of mixed types ---------------------------------------------------------------

HIDDEN = FFN = 256  # K of every matrix: a multiple of the K-quants' 256-element blocks
HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 64, 96
# Layer 0 fuses parts of different types (q | k | v: int4 / int8 with mins and int8 at group 16 ->
# int8 with mins, g16; gate | up: symmetric int4 and int4 with mins -> int8 with mins); layer 1 fuses
# parts of one type (int8; int4 with mins).
LAYER_TYPES = [
    dict(attn_q="Q4_K", attn_k="Q5_K", attn_v="Q6_K", attn_output="Q4_0", ffn_gate="Q4_0", ffn_up="Q4_1",
         ffn_down="Q5_0"),
    dict(attn_q="Q8_0", attn_k="Q8_0", attn_v="Q8_0", attn_output="Q5_K", ffn_gate="Q4_K", ffn_up="Q4_K",
         ffn_down="Q6_K"),
]
OUT_ROWS = dict(attn_q=HEADS * HEAD_DIM, attn_k=KV_HEADS * HEAD_DIM, attn_v=KV_HEADS * HEAD_DIM, attn_output=HIDDEN,
                ffn_gate=FFN, ffn_up=FFN, ffn_down=HIDDEN)
FIELDS = {"llama.context_length": 64, "llama.block_count": len(LAYER_TYPES), "llama.feed_forward_length": FFN,
          "llama.embedding_length": HIDDEN, "llama.attention.head_count": HEADS,
          "llama.attention.head_count_kv": KV_HEADS, "llama.rope.dimension_count": HEAD_DIM,
          "llama.vocab_size": VOCAB, "llama.attention.layer_norm_rms_epsilon": 1e-5}


def tiny_model_file(path, retype: dict[str, str] | None = None):
    """A 2-layer Llama GGUF: a Q8_0 embedding, a Q5_1 head, matrices of :data:`LAYER_TYPES` from
    random blocks with small scales, F32 norms; ``retype``: ``{tensor: type}`` overrides."""
    rng = np.random.default_rng(0)
    types = {"token_embd.weight": ("Q8_0", VOCAB), "output.weight": ("Q5_1", VOCAB)}
    for i, layer in enumerate(LAYER_TYPES):
        types |= {f"blk.{i}.{name}.weight": (kind, OUT_ROWS[name]) for name, kind in layer.items()}
    tensors = {}
    for name, (kind, rows) in types.items():
        kind = (retype or {}).get(name, kind)
        tensors[name] = (kind, random_blocks(rng, kind, rows, HIDDEN, scale=2e-3))
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(len(LAYER_TYPES))
                                       for n in ("attn_norm", "ffn_norm")]
    tensors |= {name: ("F32", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)) for name in norms}
    return write_gguf(path, tensors, FIELDS)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return tiny_model_file(tmp_path_factory.mktemp("packed") / "tiny.gguf")


@pytest.fixture(scope="module")
def packed(tiny_file):
    return jspec.load_gguf(tiny_file, quantized=True)


@pytest.fixture(scope="module")
def plain(tiny_file):
    return jspec.load_gguf(tiny_file)


def test_matrices_keep_their_types_and_fused_parts_join_losslessly(packed, plain):
    schemes = {path: w.scheme.name for path, w in _quantized(packed).items()}
    assert schemes == {
        ".embed": "int8-g32", ".lm_head": "int8-g32-mins",
        ".layers[0].qkv": "int8-g16-mins", ".layers[0].o": "int4-g32-sym", ".layers[0].gate_up": "int8-g32-mins",
        ".layers[0].down": "int8-g32",
        ".layers[1].qkv": "int8-g32", ".layers[1].o": "int8-g32-mins", ".layers[1].gate_up": "int4-g32",
        ".layers[1].down": "int8-g16",
    }
    assert packed.embed.transposed and packed.embed.values.shape == (VOCAB, HIDDEN)
    assert packed.layers[1].gate_up.values.shape == (2 * FFN, HIDDEN // 2)  # as stored, K last: two codes a byte
    dequantized = jspec.quant.dequantize_tree(packed, jnp.float32)
    for a, b in zip(jax.tree.leaves(dequantized), jax.tree.leaves(plain), strict=True):  # q/k rows un-permuted too
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def _quantized(tree) -> dict[str, QuantizedWeight]:
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_quantized)
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves if is_quantized(leaf)}


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]


def test_logits_equal_the_dequantized_models(packed, plain):
    logits = np.asarray(jspec.score(packed, PROMPTS))
    expected = np.asarray(jspec.score(plain, PROMPTS))
    assert expected.std() > 0.1  # the random weights give logits that tell tokens apart
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("drafter", ["ngram", "itself"])
def test_greedy_speculation_on_the_packed_model_is_lossless(packed, drafter):
    greedy = jspec.generate(packed, PROMPTS, 12)
    draft = NGram() if drafter == "ngram" else DraftModel(packed)  # a packed drafter: every draft accepted
    result = jspec.speculative_generate(packed, draft, PROMPTS, 12, num_draft_tokens=3)
    assert result.tokens == greedy


def test_bfloat16_scales_and_the_front_door(tiny_file, packed):
    half = jspec.io.load_model(str(tiny_file), dtype=jnp.bfloat16, quantized=True)
    for path, w in _quantized(half).items():
        assert w.dtype == jnp.bfloat16 and w.scheme == _quantized(packed)[path].scheme, path
        np.testing.assert_array_equal(w.values, _quantized(packed)[path].values)  # the codes as they were
    assert half.final_norm.dtype == jnp.bfloat16


def test_a_packed_model_saves_and_restores_bit_exactly(packed, tmp_path):
    jspec.save(packed, tmp_path / "ckpt")
    restored = jspec.restore(tmp_path / "ckpt")
    assert jax.tree.structure(restored) == jax.tree.structure(packed)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(packed), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_fused_weight_with_a_float_part_stays_an_array(tmp_path):
    path = tiny_model_file(tmp_path / "f16.gguf", retype={"blk.0.attn_v.weight": "F16"})
    packed, plain = jspec.load_gguf(path, quantized=True), jspec.load_gguf(path)
    assert not is_quantized(packed.layers[0].qkv) and is_quantized(packed.layers[1].qkv)
    np.testing.assert_array_equal(packed.layers[0].qkv, plain.layers[0].qkv)


def test_a_type_that_cannot_stay_packed_is_named_before_loading(tmp_path):
    path = tiny_model_file(tmp_path / "q2k.gguf", retype={"blk.1.ffn_down.weight": "Q2_K"})
    with pytest.raises(ValueError, match=r"'blk.1.ffn_down.weight' has type Q2_K, which jspec cannot keep packed"):
        jspec.load_gguf(path, quantized=True)
    assert jspec.load_gguf(path).layers[1].down.shape == (FFN, HIDDEN)  # dequantized, it loads


def test_quantized_is_for_gguf_files(tmp_path, packed):
    jspec.save(packed, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="quantized=True keeps a GGUF file's own quantization"):
        jspec.io.load_model(tmp_path / "ckpt", quantized=True)
