"""Chat templates: turn a list of messages into the prompt text a model was trained on.

A GGUF carries its Hugging Face chat template (Jinja) under ``tokenizer.chat_template``. It is
untrusted code, so it runs in Jinja's immutable sandbox with the same globals and filters that
transformers' ``apply_chat_template`` provides; a template written for transformers renders the
same text here.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from leat.errors import TemplateError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template: {_one_line(str(message))}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # Jinja's own tojson sorts keys and HTML-escapes <>&'; transformers' (and so every template) expects neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()
# What a template's own expressions can raise outside Jinja's exceptions: 1/0, None + 'x', 'abc'.index('z').
_PYTHON_FAILURES = (TypeError, ValueError, LookupError, ArithmeticError, AttributeError)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template: syntax error on line {e.lineno}: {_one_line(e.message)}") from None


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict] | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` with a Jinja chat ``template`` (``None``: ChatML).

    ``extra`` reaches the template as variables (e.g. ``enable_thinking=False`` for Qwen3). Any
    failure, including the template's own ``raise_exception``, is a one-line :class:`TemplateError`.
    """
    compiled = _compile(CHATML if template is None else template)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools,
            **extra,
        )
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template: {type(e).__name__}: {_one_line(e.message)}") from None
    except _PYTHON_FAILURES as e:
        raise TemplateError(f"chat template: {type(e).__name__}: {_one_line(str(e))}") from None


class ChatTemplate:
    """A model's chat template with its special-token text; ``fallback_reason`` is set when the file had none."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", fallback_reason: str | None = None):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.fallback_reason = fallback_reason

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> ChatTemplate:
        tokens = metadata.get(gguf.Keys.Tokenizer.LIST) or []
        bos = _token_text(tokens, metadata.get(gguf.Keys.Tokenizer.BOS_ID))
        eos = _token_text(tokens, metadata.get(gguf.Keys.Tokenizer.EOS_ID))
        source = metadata.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE)
        if source:
            return cls(str(source), bos, eos)
        if "<|im_start|>" in tokens:
            return cls(CHATML, bos, eos, "model has no chat template; using ChatML")
        return cls(PLAIN, bos, eos, "model has no chat template; using a plain 'role: content' format")

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **extra: Any,
    ) -> str:
        return render_chat(
            self.source,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
            **extra,
        )


def _token_text(tokens: list[str], token_id: Any) -> str:
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return ""
    return str(tokens[int(token_id)])
