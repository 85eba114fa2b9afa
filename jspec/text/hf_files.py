"""A tokenizer in an HF checkpoint directory: ``tokenizer.json`` (the ``tokenizers`` pipeline
itself), ``tokenizer_config.json`` (special tokens, BOS/EOS flags, maybe the chat template),
``chat_template.jinja``, and the EOS ids of ``generation_config.json`` (else ``config.json``);
read by ``tokenizer_parts``, written by ``tokenizer_files``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from tokenizers import Tokenizer as Backend

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(directory: Path, config: dict) -> str | None:
    """``chat_template.jinja`` if present, else the config's template (a string, or named
    templates of which the one called "default" is the chat template)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _eos_ids(directory: Path, backend: Backend, eos_token: str | None) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(directory / name).get("eos_token_id")
        if eos is not None:
            return tuple(dict.fromkeys(int(i) for i in ([eos] if isinstance(eos, int) else eos)))
    eos = None if eos_token is None else backend.token_to_id(eos_token)
    return () if eos is None else (eos,)


def tokenizer_parts(directory: Path) -> dict:
    """What ``Tokenizer`` is assembled from (see ``Tokenizer.assemble``), read from an HF directory."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"{directory} has no tokenizer.json (expected: an HF tokenizer directory, or a jspec checkpoint saved "
            "with its tokenizer by scripts/convert_hf.py or jspec.save(..., tokenizer=...))"
        )
    try:
        backend = Backend.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{tokenizer_file} is not a tokenizers file: {e}") from None
    config = _read_json(directory / "tokenizer_config.json")
    special_tokens = {n: _token_text(config[n]) for n in _SPECIAL_NAMES if _token_text(config.get(n)) is not None}
    # tokenizer.json's post-processor stands unless the config states the BOS/EOS flags (or it has none).
    states_flags = "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None
    return dict(
        backend=backend,
        special_tokens=special_tokens,
        add_bos_eos=(bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))) if states_flags else None,
        chat_template=_chat_template(directory, config),
        eos_ids=_eos_ids(directory, backend, special_tokens.get("eos_token")),
    )


def tokenizer_files(
    *, backend: Backend, special_tokens: Mapping[str, str], chat_template: str | None, eos_ids: Iterable[int]
) -> dict[str, str]:
    """The HF files of a tokenizer, from which ``tokenizer_parts`` (and transformers'
    ``AutoTokenizer``) reads the same tokenizer back.

    The BOS/EOS flags are left out of ``tokenizer_config.json``: ``tokenizer.json`` carries the
    post-processor that adds them, and a stated flag would have it rebuilt. The EOS ids go to
    ``generation_config.json`` as a list, so every id generation stops at (a GGUF's end-of-turn
    token too, or none) comes back, not only the EOS token's.

    Args:
      backend: the assembled HF ``tokenizers.Tokenizer`` (special tokens and post-processor included).
      special_tokens: ``{"bos_token": ..., "eos_token": ...}`` as the chat template sees them.
      chat_template: the Jinja source, or None.
      eos_ids: the ids generation stops at.

    Returns:
      ``{file name: contents}``: ``tokenizer.json``, ``tokenizer_config.json`` (the special tokens and
      the chat template, as transformers' ``save_pretrained`` writes them) and ``generation_config.json``.
    """
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special_tokens}
    if chat_template is not None:
        config["chat_template"] = chat_template
    return {
        "tokenizer.json": backend.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
        "generation_config.json": json.dumps({"eos_token_id": list(eos_ids)}, indent=2),
    }
