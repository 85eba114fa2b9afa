"""Drafters: each proposes draft tokens for the target through the same three functions
(``prefill``, ``propose``, ``commit``; see ``jspec.drafters.base``)."""

from jspec.drafters.draft_model import DraftModel
from jspec.drafters.ngram import NGram

__all__ = ["DraftModel", "NGram"]
