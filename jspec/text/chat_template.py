"""Chat templates: a checkpoint's Jinja template rendered the way HF transformers renders it.

Same sandboxed environment (``trim_blocks``, ``lstrip_blocks``, loop controls), the same
globals (``raise_exception``, ``strftime_now``, a restricted ``dict`` and ``namespace``), the
same ``tojson`` (not HTML-escaping, with ``ensure_ascii``/``indent``/``separators``/``sort_keys``)
and the same variables (``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the
special tokens such as ``bos_token``/``eos_token``), so a prompt is byte for byte what
``transformers``' ``apply_chat_template`` writes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attribute {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens with it):
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace
    )
    return env.from_string(source)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template (API) with the special tokens it may refer to.

    ``source``: the Jinja text (``tokenizer.chat_template`` of a GGUF, ``chat_template.jinja`` or
    ``tokenizer_config.json`` of an HF directory); ``special_tokens``: ``{"bos_token": "<s>", ...}``.
    """

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        try:
            _compile(self.source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: {e}") from None

    def render(
        self,
        messages: Sequence[Mapping],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping] | None = None,
        documents: Sequence[Mapping] | None = None,
        **variables,
    ) -> str:
        """The conversation as the model's prompt text. ``messages``: ``[{"role": ..., "content": ...}]``
        (keys whose value is None are dropped, as transformers does); ``add_generation_prompt`` appends
        the header of the assistant's turn; extra keyword arguments reach the template as variables
        and override the special tokens."""
        if not messages:
            raise ValueError("cannot render an empty conversation: give at least one message")
        for m in messages:
            if not isinstance(m, Mapping):
                raise ValueError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return _compile(self.source).render(
            messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **variables},
        )
