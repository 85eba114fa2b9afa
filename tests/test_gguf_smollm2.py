"""A real model: SmolLM2-135M-Instruct from its PyPI GGUF (Llama architecture, Q4_1 with a Q8_0
embedding), loaded by jspec and by transformers' GGUF loader, on real text in float32."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jspec
from jspec.drafters import NGram
from tests import hf_oracle


@pytest.fixture(scope="module")
def reference(smollm2_gguf, tmp_path_factory):
    """transformers' token ids, logits and greedy tokens on real text
    (tests/hf_reference/gguf_files.py, cmd_gguf_real)."""
    out = hf_oracle.once_per_run(tmp_path_factory, "hf_smollm2_reference",
                                 lambda out: hf_oracle.run("gguf-real", str(smollm2_gguf), str(out)))
    ref = np.load(out / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(2)]
    return dict(prompts=prompts, logits=ref["logits"], generated=[ref[f"generated_{i}"].tolist() for i in range(2)])


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return jspec.load_gguf(smollm2_gguf)


def test_config_is_smollm2(smollm2):
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0


def test_logits_match_transformers(smollm2, reference):
    logits = np.asarray(jspec.score(smollm2, reference["prompts"][:1]))[0]
    expected = reference["logits"]
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5


@pytest.fixture(scope="module")
def greedy(smollm2, reference):
    return jspec.generate(smollm2, reference["prompts"], len(reference["generated"][0]))


def test_greedy_tokens_match_transformers(greedy, reference):
    assert greedy == reference["generated"]


def test_ngram_speculative_decoding_is_lossless(smollm2, reference, greedy):
    result = jspec.speculative_generate(smollm2, NGram(), reference["prompts"], len(greedy[0]), num_draft_tokens=4)
    assert result.tokens == greedy
    assert (result.stats["accepted"] > 0).all()  # drafts were accepted, not only rejected


def _device_bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def smollm2_packed(smollm2_gguf):
    return jspec.load_gguf(smollm2_gguf, quantized=True)


def test_packed_model_is_a_fraction_of_the_dequantized_ones_memory(smollm2, smollm2_packed, smollm2_gguf):
    """Q4_1 layers as int4 with fp32 scales and mins (0.75 bytes a weight), the Q8_0 embedding as int8
    with fp32 scales (1.125): about a fifth of float32's 4 bytes, near the file's own size."""
    packed, full = _device_bytes(smollm2_packed), _device_bytes(smollm2)
    assert smollm2_packed.embed.scheme.name == "int8-g32" and smollm2_packed.layers[0].qkv.scheme.name == "int4-g32"
    assert packed < 0.25 * full and packed < 1.3 * smollm2_gguf.stat().st_size, (packed, full)


def test_packed_greedy_tokens_equal_the_dequantized_models(smollm2_packed, reference, greedy):
    """Its weights dequantize exactly to the float32 model's, and each matmul dequantizes, then runs
    the same float32 dot: the same tokens."""
    prompt = reference["prompts"][:1]
    assert jspec.generate(smollm2_packed, prompt, 8) == [greedy[0][:8]]
