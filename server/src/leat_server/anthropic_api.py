"""Anthropic Messages (``POST /v1/messages``): content blocks in, content blocks and stream events out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from msgspec import Struct

from leat_server import constrained
from leat_server.errors import bad_request, unsupported
from leat_server.images import Images
from leat_server.openai_api import plan_tools, prefilled, sse, template_tools, tool_constraint
from leat_server.reasoning import Reasoning
from leat_server.schemas import (
    AImage,
    AMessage,
    ARedactedThinking,
    AText,
    AThinking,
    AThinkingConfig,
    ATool,
    AToolChoice,
    AToolResult,
    AToolUse,
    MessagesRequest,
)
from leat_server.service import Job, Service

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


class CountTokensRequest(Struct, forbid_unknown_fields=True):
    model: str
    messages: list[AMessage]
    system: str | list[AText] | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: AThinkingConfig | None = None


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, AText):
            raise unsupported(f"{where}[{j}]", f"{block.__struct_config__.tag} content is not supported here")
        parts.append(block.text)
    return "".join(parts)


def template_messages(system: Any, messages: list[AMessage], images: Images) -> list[dict[str, Any]]:
    """Anthropic messages as chat templates expect them; each image block becomes a marker in its message's text,
    its bytes kept in ``images``."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, reasoning, calls = [], [], []
        for j, block in enumerate(m.content):
            if isinstance(block, AText):
                text.append(block.text)
            elif isinstance(block, AImage):
                text.append(images.source(block.source, f"{where}[{j}]"))
            elif isinstance(block, AThinking):
                reasoning.append(block.thinking)
            elif isinstance(block, ARedactedThinking):
                continue
            elif isinstance(block, AToolUse):
                if m.role != "assistant":
                    raise bad_request(f"{where}[{j}]: tool_use blocks belong to assistant messages", f"{where}[{j}]")
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
                )
            elif isinstance(block, AToolResult):
                if m.role != "user":
                    raise bad_request(f"{where}[{j}]: tool_result blocks belong to user messages", f"{where}[{j}]")
                if text:  # keep the order: text before the result is its own user message
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                content = _text(block.content, f"{where}[{j}].content")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": ("Error: " + content) if block.is_error else content,
                    }
                )
            else:
                raise unsupported(f"{where}[{j}]", f"{block.__struct_config__.tag} content is not supported here")
        if text or calls or reasoning or m.role == "assistant":
            entry: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                entry["tool_calls"] = calls
            if reasoning:
                entry["reasoning_content"] = "".join(reasoning)
            out.append(entry)
    return out


def _tools(tools: list[ATool] | None) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools or []):
        if t.type not in (None, "custom"):
            raise unsupported(
                f"tools[{i}]", f"server tool {t.type!r} is not supported; give client tools with input_schema"
            )
        out.append({"name": t.name, "description": t.description, "parameters": t.input_schema})
    return out


def _choice(choice: AToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs a name", "tool_choice.name")
        return {"name": choice.name}
    return {"any": "required"}.get(choice.type, choice.type)


def _reasoning(thinking: AThinkingConfig | None) -> Reasoning:
    if thinking is None:
        return Reasoning()
    return Reasoning(enabled=thinking.type != "disabled", budget=thinking.budget_tokens)


def messages_job(service: Service, body: MessagesRequest, owner: str | None) -> Job:
    if body.container is not None:
        raise unsupported("container", "code-execution containers are not supported")
    tools = _tools(body.tools)
    rendered_tools, mode, forced = plan_tools(service, tools, _choice(body.tool_choice))
    images = Images()
    messages = template_messages(body.system, body.messages, images)
    reasoning = _reasoning(body.thinking)
    text, ids, spans = service.render_chat(
        messages, rendered_tools, reasoning.template_vars(), images, continue_final=prefilled(messages)
    )
    stops = [s for s in body.stop_sequences or [] if s]
    return Job(
        endpoint="messages",
        prompt_ids=ids,
        images=spans,
        max_tokens=body.max_tokens,
        sampling=service.sampling({"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}),
        stop=stops,
        processors=(tool_constraint(service, tools, forced) if forced else _format(service, body))
        + reasoning.processors(service, text, "thinking"),
        parser=service.output_parser(mode == "auto", text),
        forced_calls=forced,
        skip_special=service.skip_special(mode == "auto"),
        client=(body.metadata or {}).get("user_id"),
        session=body.session,
        owner=owner,
    )


def _format(service: Service, body: MessagesRequest) -> list:
    fmt = body.output_config.format if body.output_config else None
    if fmt is None:
        return []
    if not service.supports("processors"):
        raise unsupported(
            "output_config.format", "structured output needs constrained decoding, which this engine does not offer yet"
        )
    return [constrained.processor(service, fmt.schema, "output_config.format")]


def count_tokens(service: Service, body: CountTokensRequest) -> int:
    tools = _tools(body.tools)
    rendered_tools = template_tools(tools) if tools and _choice(body.tool_choice) != "none" else None
    images = Images()
    messages = template_messages(body.system, body.messages, images)
    extra = _reasoning(body.thinking).template_vars()
    _, ids, _ = service.render_chat(messages, rendered_tools, extra, images, continue_final=prefilled(messages))
    return len(ids)


def _stop(job: Job) -> tuple[str, str | None]:
    r = job.result
    if r.finish_reason == "stop" and r.stop_sequence is not None:
        return "stop_sequence", r.stop_sequence
    return STOP_REASONS.get(r.finish_reason, "end_turn"), None


def _tool_use(call: Any) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def messages_body(service: Service, job: Job) -> dict[str, Any]:
    r = job.result
    content: list[dict[str, Any]] = []
    if r.reasoning:
        content.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.content or not (r.tool_calls or r.reasoning):
        content.append({"type": "text", "text": r.content})
    content += [_tool_use(c) for c in r.tool_calls]
    reason, sequence = _stop(job)
    return {
        "id": f"msg_{job.id}",
        "type": "message",
        "role": "assistant",
        "model": service.name,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": r.prompt_tokens - r.cached_tokens,
            "cache_read_input_tokens": r.cached_tokens,
            "output_tokens": r.completion_tokens,
        },
    }


async def messages_stream(service: Service, job: Job, handle: Any) -> AsyncIterator[bytes]:
    def event(name: str, **fields: Any) -> bytes:
        return sse({"type": name, **fields}, name)

    message = {
        "id": f"msg_{job.id}",
        "type": "message",
        "role": "assistant",
        "model": service.name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(job.prompt_ids), "output_tokens": 0},
    }
    yield event("message_start", message=message)
    index, open_kind = -1, None

    def close() -> list[bytes]:
        nonlocal open_kind
        out = []
        if open_kind == "reasoning":
            out.append(event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""}))
        if open_kind is not None:
            out.append(event("content_block_stop", index=index))
        open_kind = None
        return out

    async for piece in service.stream(job, handle):
        if piece.kind == "tool_call":
            for chunk in close():
                yield chunk
            index += 1
            block = _tool_use(piece.call)
            yield event("content_block_start", index=index, content_block={**block, "input": {}})
            yield event(
                "content_block_delta",
                index=index,
                delta={"type": "input_json_delta", "partial_json": piece.call.arguments},
            )
            yield event("content_block_stop", index=index)
            continue
        if not piece.text:
            continue
        if piece.kind != open_kind:
            for chunk in close():
                yield chunk
            index += 1
            open_kind = piece.kind
            start = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if piece.kind == "reasoning"
                else {"type": "text", "text": ""}
            )
            yield event("content_block_start", index=index, content_block=start)
        delta = (
            {"type": "thinking_delta", "thinking": piece.text}
            if piece.kind == "reasoning"
            else {"type": "text_delta", "text": piece.text}
        )
        yield event("content_block_delta", index=index, delta=delta)
    for chunk in close():
        yield chunk
    if index < 0:  # an empty answer is still one (empty) text block
        yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield event("content_block_stop", index=0)
    reason, sequence = _stop(job)
    usage = {"output_tokens": job.result.completion_tokens}
    fields: dict[str, Any] = {}
    receipt = service.receipt(job)
    if receipt is not None:
        fields["receipt"] = receipt
    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage, **fields)
    yield event("message_stop")
