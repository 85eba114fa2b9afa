"""A real model: SmolLM2-135M-Instruct from its PyPI GGUF (Llama architecture, Q4_1 with a Q8_0
embedding), loaded by jspec and by transformers' GGUF loader, on real text in float32."""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from jspec.drafters import NGram
from tests import hf_oracle


@pytest.fixture(scope="module")
def reference(smollm2_gguf, tmp_path_factory):
    """transformers' token ids, logits and greedy tokens on real text
    (tests/hf_reference/gguf_files.py, cmd_gguf_real)."""
    out = tmp_path_factory.mktemp("smollm2_reference")
    hf_oracle.run("gguf-real", str(smollm2_gguf), str(out))
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
