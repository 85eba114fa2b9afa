"""Plain sampled ``jspec.generate`` (temperature, top-k, top-p) draws the next token from the
distribution transformers' ``generate`` samples from: the logits processors HF builds for a
``GenerationConfig(do_sample=True, ...)`` (its own list, in its own order: temperature, top-k,
top-p), run in the reference environment on jspec's next-token logits, against the counts of many
one-token samples (chi-square; a sample of a token HF filters out fails at once)."""

from __future__ import annotations

import json
import subprocess

import jax
import numpy as np

import jspec
from tests import hf_oracle
from tests.stats import assert_matches_distribution
from tests.tiny import tiny_model

VOCAB = 16
PROMPT = [3, 1, 4]
NUM_SAMPLES = 4_000  # per setting: one-token generations of a batch of identical prompts
SETTINGS = [  # (sampling arguments, how many tokens HF's processors leave a non-zero probability)
    (dict(temperature=0.6), VOCAB),
    (dict(temperature=1.4, top_k=5), 5),
    # top-p over the top 3 renormalized keeps 2 tokens; top-p first, then top-k, would keep 3
    (dict(temperature=0.8, top_k=3, top_p=0.7), 2),
]

# Runs with the reference environment's Python: logits (.npy) and settings (JSON) in, HF's
# sampling probabilities out (.npy, one row per setting).
HF_PROBABILITIES = """
import json, sys
import numpy as np, torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

logits = torch.tensor(np.load(sys.argv[1]), dtype=torch.float32)[None]
generate = type("Generate", (GenerationMixin,), {})()  # _get_logits_processor reads nothing of a model here
rows = []
for setting in json.loads(sys.argv[2]):
    config = GenerationConfig(do_sample=True, **{"top_k": None, "top_p": None, **setting})  # jspec: None is off
    processors = generate._get_logits_processor(config)
    scores = processors(torch.zeros((1, 1), dtype=torch.long), logits.clone())
    rows.append(torch.softmax(scores.double(), dim=-1)[0].numpy())
np.save(sys.argv[3], np.stack(rows))
"""


def _hf_probabilities(logits, settings, tmp_path):
    np.save(tmp_path / "logits.npy", logits)
    proc = subprocess.run([str(hf_oracle.reference_python()), "-c", HF_PROBABILITIES, str(tmp_path / "logits.npy"),
                           json.dumps(settings), str(tmp_path / "probs.npy")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return np.load(tmp_path / "probs.npy")


def test_sampled_generate_has_hfs_distribution(tmp_path):
    target = tiny_model(1, vocab_size=VOCAB, num_layers=1, hidden_size=32, intermediate_size=32, num_heads=2,
                        num_kv_heads=1)
    logits = np.asarray(jspec.score(target, np.array([PROMPT]))[0, -1], np.float32)
    probs = _hf_probabilities(logits, [setting for setting, _ in SETTINGS], tmp_path)
    for i, (setting, kept) in enumerate(SETTINGS):
        assert (probs[i] > 0).sum() == kept, setting  # the filters have teeth: the cases are what they say
        tokens = jspec.generate(target, [PROMPT] * NUM_SAMPLES, 1, key=jax.random.key(i), **setting)
        assert_matches_distribution(np.array(tokens)[:, 0], probs[i])
