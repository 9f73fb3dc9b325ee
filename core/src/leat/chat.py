"""Chat templates: turn a list of messages into the prompt text a model was trained on.

A GGUF carries its Hugging Face chat template (Jinja) under ``tokenizer.chat_template``. It is
untrusted code, so it runs in Jinja's immutable sandbox with the same globals and filters that
transformers' ``apply_chat_template`` provides; a template written for transformers renders the
same text here.

A render is also bounded, because a template and the messages it is given can make it run or grow
without end: it stops after :attr:`RenderLimits.seconds` (a trace function checks the clock on every
line of template code, so a loop or a recursion cannot outlast it), no string, list or output it
builds may exceed :attr:`RenderLimits.chars` (checked before ``*``, ``+``, ``%``, ``~``, joins,
``replace`` and the padding methods and filters allocate), and integers given to those as widths
or grown by ``*`` / ``**`` are capped.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, wraps
from string import Formatter
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
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


@dataclass(frozen=True)
class RenderLimits:
    """How long one render may take and how large a string (or list) it may build, its output included."""

    seconds: float = 5.0
    chars: int = 1 << 26


DEFAULT_LIMITS = RenderLimits()
MAX_WIDTH = 100_000  # an integer a template passes to a filter or to a padding method (center, ljust, zfill, ...)
MAX_INT_BITS = 1 << 16  # of an integer made by * or **
_PADDING = {"center", "ljust", "rjust", "zfill", "expandtabs"}
_PRINTF = re.compile(r"%[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")
_active = threading.local()  # the limits of the render running on this thread


class _OverBudget(BaseException):
    """Raised inside a render that went past its limits. A BaseException, so that no ``except Exception`` on the way
    (in Jinja or a filter) can swallow it and let the render go on."""


def _limits() -> RenderLimits:
    return getattr(_active, "limits", DEFAULT_LIMITS)


def _check_size(size: int) -> None:
    if size > _limits().chars:
        raise _OverBudget(f"it would build a string or list of {size:,} items (the limit is {_limits().chars:,})")


def _check_width(value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_WIDTH:
        raise _OverBudget(f"it passes {value:,} as a width or count (the limit is {MAX_WIDTH:,})")


def _check_printf(text: str) -> None:
    for width, precision in _PRINTF.findall(text):
        for value in (width, precision):
            if value == "*":
                raise _OverBudget("it uses a '*' width in a %-format")
            if value:
                _check_width(int(value))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    sized = (str, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sized):
            left, right = right, left
        if isinstance(left, sized) and isinstance(right, int):
            _check_size(len(left) * max(right, 0))
        elif isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _OverBudget(f"it multiplies integers past {MAX_INT_BITS} bits")
    elif operator == "**":
        if (
            isinstance(left, int)
            and isinstance(right, int)
            and right * max(abs(left).bit_length() - 1, 0) > MAX_INT_BITS
        ):
            raise _OverBudget(f"it raises an integer past {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, sized) and isinstance(right, sized):
            _check_size(len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _check_printf(left)


def _check_replace(text: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        times = text.count(old) if not isinstance(count, int) or count < 0 else min(count, text.count(old))
        _check_size(len(text) + times * (len(new) - len(old)))


def _check_join(parts: Any, separator: Any = "") -> None:
    if isinstance(parts, (list, tuple)) and isinstance(separator, str):
        _check_size(sum(len(p) if isinstance(p, str) else 0 for p in parts) + len(separator) * len(parts))


def _check_result(value: Any) -> Any:
    if isinstance(value, (str, list, tuple)):
        _check_size(len(value))
    return value


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(obj, "__name__", "")
    if name in _PADDING:
        for value in (*args, *kwargs.values()):
            _check_width(value)
    elif name == "replace":
        _check_replace(owner, *args[:3])
    elif name == "join" and args:
        _check_join(args[0], owner)


_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)  # what pass_context & co. add


def _bounded_filter(name: str, function: Any) -> Any:
    @wraps(function)  # keeps Jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        values = [a for a in args if not isinstance(a, _PASSED)]
        for value in (*values[1:], *kwargs.values()):
            _check_width(value)
        if name == "replace":
            _check_replace(*values[:4])
        elif name == "join" and values:
            _check_join(values[0], values[1] if len(values) > 1 else kwargs.get("d", ""))
        elif name == "format" and values and isinstance(values[0], str):
            _check_printf(values[0])
        return _check_result(function(*args, **kwargs))

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        """``a ~ b`` through the environment's size check, not Jinja's unchecked ``str_join``."""
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every way to grow a string or an integer checked first (see the module)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _check_result(super().call_binop(context, operator, left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_call(obj, args, kwargs)
        return _check_result(super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        # checked when called, not here: Jinja also gets attributes while compiling constant expressions
        def checked(*args: Any, **kwargs: Any) -> str:
            for _, _, spec, _ in Formatter().parse(value.__self__):
                for number in re.findall(r"\d+", spec or ""):
                    _check_width(int(number))
            return wrapped(*args, **kwargs)

        return checked

    def concat(self, parts: Any) -> str:  # a block's, macro's or {% set %}'s output
        parts = parts if isinstance(parts, list) else list(parts)
        _check_join(parts)
        return "".join(parts)

    def concat_values(self, values: tuple) -> str:
        return self.concat([v if isinstance(v, str) else str(v) for v in values])


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()
# What a template's own expressions can raise outside Jinja's exceptions: 1/0, None + 'x', 'abc'.index('z'),
# a macro that calls itself without end.
_PYTHON_FAILURES = (TypeError, ValueError, LookupError, ArithmeticError, AttributeError, RecursionError)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template: syntax error on line {e.lineno}: {_one_line(e.message)}") from None
    except _OverBudget as e:  # Jinja evaluates constant expressions while compiling
        raise TemplateError(f"chat template: refused: {e}") from None


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
    limits: RenderLimits = DEFAULT_LIMITS,
    **extra: Any,
) -> str:
    """Render ``messages`` with a Jinja chat ``template`` (``None``: ChatML), within ``limits``.

    ``extra`` reaches the template as variables (e.g. ``enable_thinking=False`` for Qwen3); it cannot
    name this function's own parameters (:data:`RESERVED`). Any failure, including the template's own
    ``raise_exception`` and going past the limits, is a one-line :class:`TemplateError`.
    """
    compiled = _compile(CHATML if template is None else template)
    variables = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools}
    try:
        return _bounded_render(compiled, limits, bos_token=bos_token, eos_token=eos_token, **variables, **extra)
    except _OverBudget as e:
        raise TemplateError(
            f"chat template: stopped: {e}; the template or the messages it was given are at fault"
        ) from None
    except MemoryError:
        raise TemplateError("chat template: ran out of memory; the template or its messages build too much") from None
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template: {type(e).__name__}: {_one_line(e.message)}") from None
    except _PYTHON_FAILURES as e:
        raise TemplateError(f"chat template: {type(e).__name__}: {_one_line(str(e))}") from None


RESERVED = frozenset({"template", "messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "limits"})


def _bounded_render(compiled: jinja2.Template, limits: RenderLimits, **variables: Any) -> str:
    deadline = time.monotonic() + limits.seconds

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _OverBudget(f"it took more than {limits.seconds:g} s")
        return trace

    previous = sys.gettrace()
    _active.limits = limits
    sys.settrace(trace)
    try:
        parts, size = [], 0
        for part in compiled.generate(**variables):
            size += len(part)
            if size > limits.chars:
                raise _OverBudget(f"its output passed {limits.chars:,} characters")
            parts.append(part)
        return "".join(parts)
    finally:
        sys.settrace(previous)
        del _active.limits


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
        limits: RenderLimits = DEFAULT_LIMITS,
        **extra: Any,
    ) -> str:
        return render_chat(
            self.source,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
            limits=limits,
            **extra,
        )


def _token_text(tokens: list[str], token_id: Any) -> str:
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return ""
    return str(tokens[int(token_id)])
