"""Parallel draft models (PARD): a draft model whose mask-token rows after the root draft the later
tokens, all k in one forward; lossless like every drafter, and its rows line up with the chain's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import jspec
from jspec.drafters import DraftModel
from tests.hidden_drafters import check_greedy_lossless
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("seed, batch, k, eos", [(0, 3, 4, False), (1, 2, 1, True), (2, 4, 6, False)])
def test_greedy_parallel_drafting_equals_greedy(seed, batch, k, eos):
    target = tiny_model(seed)
    drafter = DraftModel(tiny_model(seed + 100, num_layers=1), parallel_token=target.config.vocab_size - 1)
    check_greedy_lossless(target, drafter, seed, batch, k, eos)  # ragged prompts, some shorter than k


def test_the_roots_row_drafts_what_the_chain_drafts_first():
    """The target as its own parallel draft: the root's row is a plain decode step, so every round
    accepts its first draft (and the mask rows, which the target was never trained on, little)."""
    target = tiny_model(3)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    result = jspec.speculative_generate(target, DraftModel(target, parallel_token=96), prompts, 24, num_draft_tokens=3)
    assert result.tokens == jspec.generate(target, prompts, 24)
    assert (result.stats["accepted"] >= result.stats["rounds"] - 1).all()  # the last round may be cut short


def test_load_reads_pard_token_and_names_a_missing_one(tmp_path):
    case = tmp_path / "pard"
    shutil.copytree(ROOT / "checkpoints" / "tiny-llama3", case)
    with pytest.raises(ValueError, match="pard_token"):
        DraftModel.load(case, parallel=True)
    config = json.loads((case / "config.json").read_text())
    (case / "config.json").write_text(json.dumps(dict(config, pard_token=config["vocab_size"] - 1)))
    drafter = DraftModel.load(case, parallel=True)
    assert drafter.parallel_token == config["vocab_size"] - 1 and DraftModel.load(case).parallel_token is None
    target = jspec.load_hf(case)
    with pytest.raises(ValueError, match="chains only"):
        jspec.speculative_generate(target, drafter, [[1, 2, 3]], 4, num_draft_tokens=3, topk=2, depth=2)
