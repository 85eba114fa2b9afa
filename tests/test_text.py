"""Text in and out: a tokenizer built from a GGUF, and from the HF directory transformers writes of
it, encodes, decodes and renders chats exactly as transformers does. Two files: SmolLM2-135M-Instruct
(byte-level BPE with GPT-2's split, ChatML template) and a small Llama-3-style file written here
(the llama-bpe split, BOS added, a user-defined token, a template closing turns with <|eot_id|>)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

import jspec
from jspec.text import ChatTemplate, Tokenizer
from tests import hf_oracle
from tests.tiny import TINY, tiny_model, write_tiny_hf_tokenizer

TEXTS = [
    "Hello world!",
    "",
    "  leading, trailing and  double  spaces  \n\n\ttabs\r\nand a Windows newline\n",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nprint(list(map(fib, range(9))))",
    "naïve café — 日本語のテキスト, emoji 🎉👍🏽, Ελληνικά, русский, العربية",
    "Numbers 3.14159 and 2024-11-25; x**2 != y//3 && z >= 1e-5",
    "don't, you're, I'LL, they've",
    "<|im_start|>user\nspecial tokens inline<|im_end|> and <|endoftext|>",
]

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is speculative decoding?"}
ASSISTANT = {"role": "assistant", "content": "A draft proposes, the target verifies."}
UNICODE_USER = {"role": "user", "content": "Übersetze: «где 🎉?»\n  def f(x):\n\treturn x"}

# Exercises what the environment provides: tojson with options (no HTML escaping), namespace,
# loop controls, the generation tag, dict(), tools and the special tokens as variables.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% if tools %}{{ tools | tojson(indent=2, sort_keys=True) }}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{{ ns.n }}|{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content | tojson }}{% endif %}{{ eos_token }}\n"
    "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
    "{{ dict(a=1) | tojson(separators=(',', ':')) }}{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find <b>&</b> things",
                                           "parameters": {"type": "object", "properties": {}}}}]

CHATS = [
    dict(messages=[USER], add_generation_prompt=True),
    dict(messages=[SYSTEM, USER], add_generation_prompt=True),
    dict(messages=[SYSTEM, USER, ASSISTANT, UNICODE_USER], add_generation_prompt=True),
    dict(messages=[USER, ASSISTANT], add_generation_prompt=False),
    dict(messages=[SYSTEM, USER, ASSISTANT], add_generation_prompt=False),
    dict(messages=[SYSTEM, USER, ASSISTANT, UNICODE_USER], add_generation_prompt=True, template=FEATURE_TEMPLATE,
         tools=TOOLS),
]


LLAMA3_TEMPLATE = (
    "{{- bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def write_llama3_style_gguf(path: Path) -> Path:
    """A GGUF carrying only a tokenizer, shaped like Llama 3's: a byte-level BPE trained here, control
    tokens, a user-defined token, the llama-bpe split, add_bos_token and a template ending turns with
    <|eot_id|> (while its EOS is <|end_of_text|>)."""
    corpus = ["Speculative decoding lets a small model propose tokens that a large model verifies.",
              "def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog 1234567890."]
    bpe = Backend(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(corpus * 20, trainer)
    trained = json.loads(bpe.to_str())["model"]
    control = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokens = sorted(trained["vocab"], key=trained["vocab"].get) + control + ["<think>"]
    types = [1] * len(trained["vocab"]) + [3] * len(control) + [4]  # normal, control, user-defined
    w = gguf.GGUFWriter(path, "llama")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, len(tokens)),
                       (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "llama-bpe"), (w.add_token_list, tokens),
                       (w.add_token_types, types), (w.add_token_merges, [" ".join(m) for m in trained["merges"]]),
                       (w.add_bos_token_id, tokens.index("<|begin_of_text|>")),
                       (w.add_eos_token_id, tokens.index("<|end_of_text|>")), (w.add_add_bos_token, True),
                       (w.add_chat_template, LLAMA3_TEMPLATE)]:
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(smollm2_gguf, tmp_path_factory):
    shared = hf_oracle.once_per_run(tmp_path_factory, "llama3_style_gguf",
                                    lambda out: write_llama3_style_gguf(out / "llama3-style.gguf"))
    return {"smollm2": Path(smollm2_gguf), "llama3-style": shared / "llama3-style.gguf"}


@pytest.fixture(scope="module")
def references(gguf_files, tmp_path_factory):
    """transformers' tokenizer of each GGUF on TEXTS and CHATS, and its HF directory
    (tests/hf_reference/gguf_files.py, cmd_tokenizer)."""
    def make(out):
        cases = out / "cases.json"
        cases.write_text(json.dumps(dict(texts=TEXTS, chats=CHATS)))
        hf_oracle.run("tokenizer", str(cases), str(out), *map(str, gguf_files.values()))

    out = hf_oracle.once_per_run(tmp_path_factory, "hf_tokenizer_reference", make)
    return {name: dict(json.loads((out / path.stem / "reference.json").read_text()), hf_dir=out / path.stem / "hf")
            for name, path in gguf_files.items()}


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_files):
    return Tokenizer.from_pretrained(gguf_files["smollm2"])


SOURCES = ["smollm2 gguf", "smollm2 hf_dir", "llama3-style gguf", "llama3-style hf_dir"]


@pytest.fixture(scope="module", params=SOURCES)
def source(request, gguf_files, gguf_tokenizer, references):
    """(tokenizer, transformers' reference, source name) for each file and each form of it."""
    name, form = request.param.split()
    if request.param == "smollm2 gguf":
        return gguf_tokenizer, references[name], request.param
    path = gguf_files[name] if form == "gguf" else references[name]["hf_dir"]
    return Tokenizer.from_pretrained(path), references[name], request.param


def _render(tokenizer: Tokenizer, chat: dict) -> str:
    template = tokenizer.chat_template
    if "template" in chat:
        template = ChatTemplate(chat["template"], tokenizer.special_tokens)
    return template.render(chat["messages"], add_generation_prompt=chat["add_generation_prompt"],
                           tools=chat.get("tools"))


# transformers builds a GGUF's byte-level tokenizer as GPT-2's, whose default unknown token
# <|endoftext|> it adds as a new id past the file's vocabulary when the file lacks that token (a
# Llama 3 vocabulary does). jspec keeps the file's vocabulary (the model has no row for such an id),
# so the one text spelling <|endoftext|> is not compared for the Llama-3-style GGUF.
PHANTOM = "<|endoftext|>"


def _phantom_added(name: str) -> bool:
    return name == "llama3-style gguf"  # the HF directory transformers writes has the extra token


def _texts(reference, name):
    return [(t, ref) for t, ref in zip(TEXTS, reference["texts"], strict=True)
            if not (_phantom_added(name) and PHANTOM in t)]


def test_encodings_equal_transformers(source):
    tokenizer, reference, name = source
    for text, ref in _texts(reference, name):
        assert tokenizer.encode(text) == ref["ids"], text
        assert tokenizer.encode(text, add_special_tokens=False) == ref["ids_no_special"], text


def test_decode_round_trips_and_equals_transformers(source):
    tokenizer, reference, name = source
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    for text, ref in _texts(reference, name):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == ref["decoded"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == ref["decoded_skip_special"]


def test_streaming_decode_joins_to_decode(gguf_tokenizer):
    for text in TEXTS:
        step = gguf_tokenizer.decode_stream()
        assert "".join(step(i) for i in gguf_tokenizer.encode(text)) == text


def test_chat_template_equals_transformers(source):
    tokenizer, reference, _ = source
    for chat, ref in zip(CHATS, reference["chats"], strict=True):
        text = _render(tokenizer, chat)
        assert text == ref["text"]
        assert tokenizer.encode(text, add_special_tokens=False) == ref["ids"]
    assert tokenizer.encode_chat(CHATS[0]["messages"]) == reference["chats"][0]["ids"]


def test_special_tokens_and_vocabulary(source):
    tokenizer, reference, name = source
    assert tokenizer.special_tokens == reference["special_tokens"]
    assert tokenizer.vocab_size == reference["vocab_size"] - _phantom_added(name)
    if _phantom_added(name):
        assert tokenizer.token_to_id(PHANTOM) is None


# A GGUF stops at its EOS and at the token its chat template closes a turn with; an HF directory
# at its generation config's EOS ids (transformers writes the GGUF's EOS there).
EOS_TOKENS = {
    "smollm2 gguf": ["<|im_end|>"],
    "smollm2 hf_dir": ["<|im_end|>"],
    "llama3-style gguf": ["<|end_of_text|>", "<|eot_id|>"],
    "llama3-style hf_dir": ["<|end_of_text|>"],
}


def test_eos_ids(source):
    tokenizer, _, name = source
    assert tokenizer.eos_ids == tuple(tokenizer.token_to_id(t) for t in EOS_TOKENS[name])


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_hf_tokenizer(directory)
    return directory


@pytest.mark.parametrize("given", ["path", "Tokenizer"])
@pytest.mark.parametrize("name", ["smollm2 gguf", "llama3-style gguf", "tiny hf_dir"])
def test_a_tokenizer_saved_beside_the_weights_reads_back_the_same(tmp_path, gguf_files, tiny_hf_dir, name, given):
    """``jspec.save(model, path, tokenizer=...)``, given the source or its ``Tokenizer``, writes files
    from which ``Tokenizer.from_pretrained(path)`` reads the source's tokenizer back: the same ids
    with and without special tokens, decodes, chat renders, special tokens, EOS ids (a GGUF's
    end-of-turn token included) and vocabulary. Sources: GGUFs (the tokenizer built from their
    metadata) and an HF directory in forms the saved files do not take (the template in
    ``chat_template.jinja``, BOS asked for by ``add_bos_token``, two EOS ids)."""
    path = tiny_hf_dir if name == "tiny hf_dir" else gguf_files[name.split()[0]]
    source = Tokenizer.from_pretrained(path)
    model = tiny_model(vocab_size=max(source.vocab_size, TINY.vocab_size), hidden_size=16, num_heads=1,
                       num_kv_heads=1, head_dim=16, intermediate_size=16, num_layers=1)
    jspec.save(model, tmp_path / "m", tokenizer=path if given == "path" else source)
    assert jspec.restore(tmp_path / "m").config == model.config
    saved = Tokenizer.from_pretrained(tmp_path / "m")
    for text in TEXTS:
        for special in (True, False):
            assert saved.encode(text, add_special_tokens=special) == source.encode(text, add_special_tokens=special)
        ids = source.encode(text)
        for skip in (True, False):
            assert saved.decode(ids, skip_special_tokens=skip) == source.decode(ids, skip_special_tokens=skip)
    assert saved.chat_template == source.chat_template
    for chat in CHATS:
        assert _render(saved, chat) == _render(source, chat)
        assert saved.encode_chat(chat["messages"]) == source.encode_chat(chat["messages"])
    assert (saved.special_tokens, saved.eos_ids, saved.vocab_size) == (
        source.special_tokens, source.eos_ids, source.vocab_size)


def test_template_errors_are_raised(gguf_tokenizer):
    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([USER])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render([USER])


@pytest.mark.parametrize("bad, match", [
    (lambda t: t.apply_chat_template([]), "empty conversation"),
    (lambda t: t.apply_chat_template(["hi"]), "dicts with 'role' and 'content'"),
    (lambda t: ChatTemplate("{% for m in messages %}"), "does not parse"),
    (lambda t: Tokenizer(t.backend, t.special_tokens, t.eos_ids).apply_chat_template([USER]), "no chat template"),
])
def test_bad_chat_input_is_a_value_error(gguf_tokenizer, bad, match):
    with pytest.raises(ValueError, match=match):
        bad(gguf_tokenizer)


def test_bad_sources_are_value_errors(tmp_path, smollm2_gguf):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        Tokenizer.from_pretrained(tmp_path / "weights.bin")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(smollm2_gguf).read_bytes()[:100_000])
    with pytest.raises(ValueError, match="truncated"):
        Tokenizer.from_pretrained(truncated)
    with pytest.raises(ValueError, match="neither a known name"):
        Tokenizer.from_pretrained("no-such-model-name")


def test_jspec_runtime_needs_no_transformers():
    code = "import sys, jspec.text; assert 'transformers' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
