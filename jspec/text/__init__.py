"""Text in and out: a checkpoint's tokenizer on HF ``tokenizers`` (from ``tokenizer.json`` or built
from a GGUF's vocabulary and merges), its chat template rendered through jinja2 as transformers
renders it, and the ids generation stops at."""

from jspec.text.chat_template import ChatTemplate
from jspec.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "Tokenizer"]
