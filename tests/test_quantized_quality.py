"""Round-to-nearest quantization of a real model keeps its quality, within bounds stated here:
SmolLM2-135M-Instruct (the Q4_1 GGUF from PyPI, dequantized to fp32, then ``jspec.quantize``d)
scored over the committed CC0 passage (the ``gguf-quality`` benchmark's), two windows of 512 ids.

Measured (all five windows): int8 per channel 1.000x the fp32 perplexity (34.863), int4 with mins
in groups of 32 1.084x, of 64 1.54x, of 64 symmetric 1.76x. The file is already 4-bit in groups of
32, so int4 g32 nearly lands on its grid while g64 quantizes it a second time, off its grid: on this
model the int4 bound holds for g32 only (a K of 576 takes no g128)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.bench.gguf_quality import passage_text, token_nll, windows_of

WINDOWS = 2
BOUNDS = {"int8": 1.02, "int4-g32": 1.10}  # perplexity over the fp32 model's, at most


@pytest.fixture(scope="module")
def scored(smollm2_gguf):
    model = jspec.io.load_model(smollm2_gguf, dtype=jnp.float32)
    ids = jspec.Tokenizer.from_pretrained(smollm2_gguf).encode(passage_text())
    windows = np.asarray(windows_of(ids, 512)[:WINDOWS], np.int32)

    def perplexity(m) -> float:
        logits = np.asarray(jspec.score(m, windows))
        return float(np.exp(np.concatenate([token_nll(row, w)[0] for row, w in zip(logits, windows)]).mean()))

    return model, perplexity, perplexity(model)


@pytest.mark.parametrize("scheme", sorted(BOUNDS))
def test_quantized_perplexity_stays_within_its_bound(scored, scheme):
    model, perplexity, fp32 = scored
    ratio = perplexity(jspec.quantize(model, scheme)) / fp32
    assert 0.99 < ratio <= BOUNDS[scheme], f"{scheme}: {ratio:.4f}x the fp32 perplexity {fp32:.3f}"
