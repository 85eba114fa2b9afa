"""HF transformers oracle, run in the reference environment (Python 3.11, torch, transformers) as
``python tests/hf_reference COMMAND ARGS...`` (a folder Python runs through this file).

Not imported by the jspec tests: they call it as a subprocess (see ``tests/hf_oracle.py``)
because torch and jax live in different Python environments. It writes tiny random HF
checkpoints made by transformers itself and the outputs jspec must reproduce.

  python tests/hf_reference models OUT_DIR     # one sub-directory per case, see CASES
  python tests/hf_reference eagle3 OUT_DIR     # EAGLE-3 heads (EAGLE3_CASES) + their target
  python tests/hf_reference mtp OUT_DIR        # targets with an MTP layer (MTP_CASES)
  python tests/hf_reference dflash OUT_DIR     # DFlash drafts (DFLASH_CASES) + their Qwen3 target
  python tests/hf_reference gemma4 OUT_DIR     # Gemma 4 text models (GEMMA4_CASES)
  python tests/hf_reference gemma4-assistant OUT_DIR   # Gemma 4 assistants + targets (ASSISTANT_CASES)
  python tests/hf_reference tokenizer CASES_JSON OUT_DIR GGUF...   # GGUF tokenizers, see cmd_tokenizer
  python tests/hf_reference gguf OUT_DIR       # tiny GGUF files (GGUF_CASES) read back by transformers
  python tests/hf_reference gguf-real GGUF OUT_DIR   # a real GGUF on real text, see cmd_gguf_real
  python tests/hf_reference logits TOKENS_JSON DIR...  # transformers' logits of checkpoints, see logits.py

The cases live beside the commands: CASES in common.py, EAGLE3_CASES and MTP_CASES in drafters.py, DFLASH_CASES in dflash.py,
GEMMA4_CASES and ASSISTANT_CASES in gemma4.py, GGUF_CASES in gguf_files.py (not gguf.py: Python
runs this folder with it first on the path, where a gguf.py would hide the gguf package).
"""

from __future__ import annotations

import sys

import torch
from common import cmd_models
from dflash import cmd_dflash
from drafters import cmd_eagle3, cmd_mtp
from gemma4 import cmd_gemma4, cmd_gemma4_assistant
from gguf_files import cmd_gguf, cmd_gguf_real, cmd_tokenizer
from logits import cmd_logits

COMMANDS = {
    "models": cmd_models, "eagle3": cmd_eagle3, "dflash": cmd_dflash, "mtp": cmd_mtp, "gemma4": cmd_gemma4, "tokenizer": cmd_tokenizer,
    "gemma4-assistant": cmd_gemma4_assistant, "gguf": cmd_gguf, "gguf-real": cmd_gguf_real, "logits": cmd_logits,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python tests/hf_reference {{{','.join(COMMANDS)}}} ARGS...")
    # One thread: the test suite runs this beside its workers, which keep every core busy, and torch's
    # threads spin-waiting on a core another process holds made the commands up to 3x slower. Against torch's
    # default threads only the summation order changes: the same checkpoints, GGUF files and tokens,
    # float32 logits within 3e-5 (the tests that read them allow 1e-4).
    torch.set_num_threads(1)
    COMMANDS[sys.argv[1]](*sys.argv[2:])
