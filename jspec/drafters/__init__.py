"""Drafters: each proposes draft tokens for the target through the protocol written in
``jspec.drafters.base`` (``capture``, ``check_compatible``, ``bind``, ``max_positions``,
``prefill``, ``propose``, ``commit``); the ones with weights load through ``Drafter.load(path)``."""

from jspec.drafters.base import CommitContext, Drafter, PrefillContext, RoundContext
from jspec.drafters.dflash import DFlash, DFlashConfig, DFlashHead, init_dflash_head
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.eagle3 import Eagle3, Eagle3Config, Eagle3Head, init_eagle3_head
from jspec.drafters.frozen_kv_mtp import Assistant, AssistantConfig, FrozenKVMTP, assistant_config, init_assistant
from jspec.drafters.mtp import MTP, MTPHead, init_mtp_head
from jspec.drafters.ngram import NGram

__all__ = [
    "Assistant",
    "AssistantConfig",
    "CommitContext",
    "DFlash",
    "DFlashConfig",
    "DFlashHead",
    "DraftModel",
    "Drafter",
    "Eagle3",
    "Eagle3Config",
    "Eagle3Head",
    "FrozenKVMTP",
    "MTP",
    "MTPHead",
    "NGram",
    "PrefillContext",
    "RoundContext",
    "assistant_config",
    "init_dflash_head",
    "init_assistant",
    "init_eagle3_head",
    "init_mtp_head",
]
