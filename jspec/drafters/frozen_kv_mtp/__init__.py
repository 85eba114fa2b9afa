"""The Gemma 4 assistant ("Frozen-KV MTP") drafter: parameters and one forward step
(``assistant``), ``gemma4_assistant`` checkpoints (``checkpoint``), the drafter (``drafter``).

Usage::

    target = jspec.load_hf("gemma-4-E2B-it")
    drafter = jspec.drafters.FrozenKVMTP.load("gemma-4-E2B-it-assistant")
    jspec.speculative_generate(target, drafter, prompts, 64, num_draft_tokens=4)
"""

from jspec.drafters.frozen_kv_mtp.assistant import (
    Assistant,
    AssistantConfig,
    FrozenKV,
    assistant_config,
    assistant_logits,
    assistant_step,
    init_assistant,
)
from jspec.drafters.frozen_kv_mtp.checkpoint import load_assistant
from jspec.drafters.frozen_kv_mtp.drafter import ROPE_POSITIONS, SLIDING_ROWS, FrozenKVMTP

__all__ = [
    "ROPE_POSITIONS",
    "SLIDING_ROWS",
    "Assistant",
    "AssistantConfig",
    "FrozenKV",
    "FrozenKVMTP",
    "assistant_config",
    "assistant_logits",
    "assistant_step",
    "init_assistant",
    "load_assistant",
]
