"""Text in and out of a checkpoint: its tokenizer (HF ``tokenizers``), chat template and EOS ids."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import jinja2
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend
from tokenizers.decoders import DecodeStream

from jspec.io import resolve_model
from jspec.text import gguf_vocab, hf_files
from jspec.text.chat_template import ChatTemplate

# Rendered as an assistant message to find which token closes a turn (see _end_of_turn_id).
_PROBE = "Probe reply."


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A checkpoint's tokenizer (API): ``Tokenizer.from_pretrained(spec)``.

    ``backend``: the HF ``tokenizers.Tokenizer`` (pre-tokenizer, BPE, added and special tokens,
    BOS/EOS post-processor, decoder); ``special_tokens``: ``{"bos_token": ..., "eos_token": ...}``
    as the chat template sees them; ``eos_ids``: the ids generation stops at;
    ``chat_template``: the checkpoint's template, or None when it has none.
    """

    backend: Backend = dataclasses.field(repr=False)
    special_tokens: Mapping[str, str]
    eos_ids: tuple[int, ...]
    chat_template: ChatTemplate | None = None

    @classmethod
    def from_pretrained(cls, spec: str | Path) -> Tokenizer:
        """The tokenizer of a GGUF file, an HF directory (``tokenizer.json``, ``tokenizer_config.json``,
        ``chat_template.jinja``, ``generation_config.json``) or a known model name (fetched as
        ``jspec.io.resolve_model`` does). EOS ids: the generation config's for an HF directory; for
        a GGUF its EOS/EOT ids plus the token that closes a turn in its chat template
        (``<|im_end|>``). Raises ``ValueError`` naming what is missing or unsupported."""
        path = resolve_model(spec)
        if path.is_dir():
            return cls.assemble(**hf_files.tokenizer_parts(path))
        return cls.assemble(**gguf_vocab.tokenizer_parts(path), end_of_turn=True)

    @classmethod
    def assemble(
        cls,
        *,
        backend: Backend,
        special_tokens: Mapping[str, str],
        add_bos_eos: tuple[bool, bool] | None,
        chat_template: str | None,
        eos_ids: Iterable[int],
        end_of_turn: bool = False,
    ) -> Tokenizer:
        """Finish a backend as transformers does: the named special tokens stay whole, and unless
        ``add_bos_eos`` is None the post-processor adds BOS/EOS as stated. ``end_of_turn``: add the
        token closing a turn in the chat template to ``eos_ids``."""
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in special_tokens.values() if t not in added]
        )
        if add_bos_eos is not None:
            backend.post_processor = _bos_eos_processor(backend, special_tokens, *add_bos_eos)
        template = None if chat_template is None else ChatTemplate(chat_template, dict(special_tokens))
        tokenizer = cls(backend, dict(special_tokens), tuple(eos_ids), template)
        closing = tokenizer._end_of_turn_id() if end_of_turn else None
        if closing is not None and closing not in tokenizer.eos_ids:
            tokenizer = dataclasses.replace(tokenizer, eos_ids=(*tokenizer.eos_ids, closing))
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (a model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` lets the post-processor add BOS/EOS."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, *, skip_special_tokens: bool = False) -> Callable[[int], str]:
        """An incremental decoder: call it with each new id, get the text that id completes ("" while
        a multi-byte character is still split across tokens). The pieces join to ``decode(ids)``."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(self.backend, int(token_id)) or ""

    def apply_chat_template(
        self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **variables
    ) -> str:
        """The conversation as prompt text, rendered as transformers' ``apply_chat_template`` does
        (note the default: the assistant's turn header is appended, as a generation prompt needs)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; encode the text directly")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **variables) -> list[int]:
        """Token ids of the rendered conversation (the template writes any BOS itself, so the
        post-processor adds none, as in transformers)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False)

    def to_hf_files(self) -> dict[str, str]:
        """This tokenizer as HF files, which ``from_pretrained`` on the directory holding them reads
        back as the same tokenizer (same ids, decodes, chat template and EOS ids), whatever it was
        read from (a GGUF's included).

        Returns:
          ``{file name: contents}``; see ``jspec.text.hf_files.tokenizer_files``.
        """
        return hf_files.tokenizer_files(
            backend=self.backend, special_tokens=self.special_tokens,
            chat_template=None if self.chat_template is None else self.chat_template.source, eos_ids=self.eos_ids,
        )

    def _end_of_turn_id(self) -> int | None:
        """The special token the chat template writes right after an assistant's reply, if any."""
        if self.chat_template is None:
            return None
        probe = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.apply_chat_template(probe, add_generation_prompt=False)
        except jinja2.exceptions.TemplateError:
            return None
        if _PROBE not in text:
            return None
        special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        after = self.encode(text[text.index(_PROBE) + len(_PROBE):], add_special_tokens=False)
        return next((i for i in after if i in special), None)


def _bos_eos_processor(backend: Backend, special_tokens: Mapping[str, str], add_bos: bool, add_eos: bool):
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    bos = bos if add_bos and bos is not None else None
    eos = eos if add_eos and eos is not None else None
    single = " ".join([f"{bos}:0"] * (bos is not None) + ["$A:0"] + [f"{eos}:0"] * (eos is not None))
    pair = " ".join([single] + [f"{bos}:1"] * (bos is not None) + ["$B:1"] + [f"{eos}:1"] * (eos is not None))
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    )
