"""Render a GGUF's `tokenizer.chat_template` (Jinja) exactly as transformers' apply_chat_template.

Same environment as transformers (`utils/chat_template_utils.py`): a sandboxed, immutable Jinja
environment with trim_blocks/lstrip_blocks, loop controls, a `{% generation %}` tag, a `tojson`
that does not HTML-escape, and the globals `raise_exception` and `strftime_now`.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

# Used when the GGUF carries no template: plain ChatML, the format of every Qwen and SmolLM model.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template cannot be compiled, or it refused / failed to render these messages."""


class _TemplateRaised(Exception):
    """What `raise_exception(...)` throws inside a template; its message is the user's."""


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask marker): body as-is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Exceptions a template can trigger while rendering (a filter given the wrong type, a missing key…).
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError,
                  ArithmeticError)


class ChatTemplate:
    """A compiled chat template; `render` turns OpenAI-style messages into the prompt text."""

    def __init__(self, source: str | None, bos_token: str | None = None,
                 eos_token: str | None = None):
        self.source = CHATML_TEMPLATE if source is None else source
        self.special_tokens = {name: text for name, text in
                               (("bos_token", bos_token), ("eos_token", eos_token)) if text}
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template syntax error at line {exc.lineno}: "
                                    f"{exc.message}") from exc

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> ChatTemplate:
        def text_of(token_id: int | None) -> str | None:
            return None if token_id is None else tok.decode([token_id])

        return cls(tok.chat_template, bos_token=text_of(tok.bos_id), eos_token=text_of(tok.eos_id))

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Prompt text for `messages`; extra kwargs (e.g. enable_thinking=False) reach the
        template as variables. Raises ChatTemplateError with the template's own message."""
        variables = {**self.special_tokens, "documents": None, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except _TemplateRaised as exc:
            raise ChatTemplateError(str(exc)) from exc
        except _RENDER_ERRORS as exc:
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
