"""Drafters: each proposes draft tokens for the target through the same three functions
(``prefill``, ``propose``, ``commit``; see ``jspec.drafters.base``)."""

from jspec.drafters.draft_model import DraftModel
from jspec.drafters.eagle3 import Eagle3, Eagle3Config, Eagle3Head, init_eagle3_head
from jspec.drafters.mtp import MTP, MTPHead, init_mtp_head
from jspec.drafters.ngram import NGram

__all__ = [
    "DraftModel",
    "Eagle3",
    "Eagle3Config",
    "Eagle3Head",
    "MTP",
    "MTPHead",
    "NGram",
    "init_eagle3_head",
    "init_mtp_head",
]
