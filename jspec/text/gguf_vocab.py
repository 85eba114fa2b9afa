"""A tokenizer from a GGUF file's metadata.

A GGUF carries no ``tokenizer.json``: llama.cpp stores the vocabulary, the merges, each token's
type, the name of the pre-tokenizer and the special token ids as metadata. They are built here
into an HF ``tokenizers`` byte-level BPE the way transformers' GGUF converter
(``transformers.integrations.gguf.gguf_tokenizer_mapping``) builds them, so both give the same ids.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from jspec.io.gguf import open_gguf

# How each pre-tokenizer splits text before the merges apply (the names are llama.cpp's
# ``tokenizer.ggml.pre``); any other name keeps GPT-2's split, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
         "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}
# Ids llama.cpp also ends generation on, where a file names them.
_END_IDS = ("eos_token_id", "eot_token_id", "eom_token_id")


def read_metadata(path: Path) -> dict:
    """The ``tokenizer.*`` metadata of a GGUF file, keys without the ``tokenizer.`` prefix;
    ``ValueError`` for a missing, foreign, truncated or corrupt file."""
    reader = open_gguf(path)
    return {k.removeprefix("tokenizer."): f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _byte_level_spelling(tokens: list[str]) -> list[str]:
    """Tokens in the byte-level alphabet: a token written with other characters (a GGUF may store
    ``"\\n"`` rather than ``"Ċ"``) is respelt from its UTF-8 bytes, as transformers does."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [t if set(t) <= alphabet else "".join(piece for piece, _ in spell.pre_tokenize_str(t)) for t in tokens]


def tokenizer_parts(path: Path) -> dict:
    """What ``Tokenizer`` is assembled from (see ``Tokenizer.assemble``), read from a GGUF file."""
    meta = read_metadata(path)
    model = meta.get("ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{path}: tokenizer model {model!r} is not supported (supported: 'gpt2', the byte-level BPE of "
            "Llama 3, Qwen2/2.5/3 and SmolLM2 GGUFs)"
        )
    tokens = list(meta["ggml.tokens"])
    token_types = list(meta.get("ggml.token_type", ()))
    if "ggml.merges" not in meta:
        raise ValueError(f"{path}: a byte-level BPE vocabulary needs tokenizer.ggml.merges, which the file lacks")
    spelled = _byte_level_spelling(tokens)
    backend = Backend(BPE(
        vocab={t: i for i, t in enumerate(spelled)},
        merges=[tuple(m.split(" ")) for m in meta["ggml.merges"]],
        dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    ))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("ggml.pre"))
    backend.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    )
    backend.decoder = decoders.ByteLevel()

    special_tokens = {name: tokens[meta[f"ggml.{key}"]] for name, key in _SPECIAL_IDS.items() if f"ggml.{key}" in meta}
    # Control tokens (<|im_end|>) stay whole; one spelt outside the byte alphabet is a mislabel and
    # adding it would grow the vocabulary past the model's, so it is left out (as transformers does).
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= alphabet]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab])
    return dict(
        backend=backend,
        special_tokens=special_tokens,
        add_bos_eos=(bool(meta.get("ggml.add_bos_token", False)), bool(meta.get("ggml.add_eos_token", False))),
        chat_template=meta.get("chat_template"),
        eos_ids=tuple(dict.fromkeys(int(meta[f"ggml.{k}"]) for k in _END_IDS if f"ggml.{k}" in meta)),
    )
