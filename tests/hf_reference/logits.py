"""``logits TOKENS_JSON DIR...``: each checkpoint directory loaded by transformers in float32 (a
quantized one as transformers itself reads it on a CPU: fine-grained FP8 dequantized), its logits on
the token rows of TOKENS_JSON written to ``DIR/transformers_logits.npy`` ``[batch, T, vocab]``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def cmd_logits(tokens_json, *dirs):
    warnings.filterwarnings("ignore")
    tokens = torch.tensor(json.loads(Path(tokens_json).read_text()))
    for directory in dirs:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        with torch.no_grad():
            logits = model(tokens).logits.float().numpy()
        np.save(Path(directory) / "transformers_logits.npy", logits)
