"""OpenAI Responses (``POST /v1/responses``): the stateless subset agents use, whole and streamed.

Nothing is stored: ``previous_response_id`` is refused, and a conversation is sent as input items
(messages, ``function_call`` and ``function_call_output``), as agents that keep their own history do.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from leat_server.errors import bad_request, from_msgspec, unsupported
from leat_server.images import Images
from leat_server.openai_api import format_constraint, plan_tools, sse, tool_constraint
from leat_server.reasoning import Reasoning
from leat_server.schemas import (
    ResponsesRequest,
    RFunctionCall,
    RFunctionCallOutput,
    RFunctionTool,
    RInputImage,
    RInputText,
    RItem,
    RMessage,
    RNamedChoice,
    ROutputText,
    RReasoning,
    RRefusal,
)
from leat_server.service import Job, Service


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _content_text(content: Any, where: str, images: Images) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, (RInputText, ROutputText)):
            parts.append(part.text)
        elif isinstance(part, RRefusal):
            parts.append(part.refusal)
        elif isinstance(part, RInputImage) and part.file_id is None:
            parts.append(images.url(part.image_url, f"{where}[{j}]"))
        else:
            raise unsupported(
                f"{where}[{j}]", f"{part.__struct_config__.tag} is not supported; this server takes text and images"
            )
    return "".join(parts)


def _items(raw: list[dict[str, Any]]) -> list[Any]:
    items = []
    for i, item in enumerate(raw):
        if isinstance(item, dict) and "type" not in item and "role" in item:
            item = {"type": "message", **item}
        try:
            items.append(msgspec.convert(item, RItem))
        except msgspec.ValidationError as e:
            error = from_msgspec(e)
            error.param = f"input[{i}]" + (f".{error.param}" if error.param else "")
            error.message = f"input[{i}]: {error.message}"
            raise error from None
    return items


def template_messages(
    instructions: str | None, input_: str | list[dict[str, Any]], images: Images
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        out.append({"role": "user", "content": input_})
        return out
    reasoning = ""
    for i, item in enumerate(_items(input_)):
        if isinstance(item, RMessage):
            role = "system" if item.role == "developer" else item.role
            entry = {"role": role, "content": _content_text(item.content, f"input[{i}].content", images)}
            if reasoning and role == "assistant":
                entry["reasoning_content"], reasoning = reasoning, ""
            out.append(entry)
        elif isinstance(item, RFunctionCall):
            try:
                args = json.loads(item.arguments) if item.arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise bad_request(f"input[{i}].arguments: not valid JSON ({e})", f"input[{i}].arguments") from None
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}}
            last = out[-1] if out else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last and last["role"] == "assistant" and not last.get("tool_calls"):
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif isinstance(item, RFunctionCallOutput):
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "content": _content_text(item.output, f"input[{i}].output"),
                }
            )
        elif isinstance(item, RReasoning):
            reasoning += "".join(str(c.get("text", "")) for c in (item.content or []))
    return out


def _tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    tools = []
    for i, tool in enumerate(raw or []):
        if tool.get("type") != "function":
            raise unsupported(f"tools[{i}]", f"tool type {tool.get('type')!r} is not supported; give function tools")
        try:
            t = msgspec.convert(tool, RFunctionTool)
        except msgspec.ValidationError as e:
            error = from_msgspec(e)
            error.param = f"tools[{i}]" + (f".{error.param}" if error.param else "")
            raise error from None
        tools.append({"name": t.name, "description": t.description, "parameters": t.parameters})
    return tools


def responses_job(service: Service, body: ResponsesRequest, owner: str | None) -> tuple[Job, dict[str, Any]]:
    if body.previous_response_id:
        raise unsupported(
            "previous_response_id", "this server stores no responses; send the whole conversation as input"
        )
    if body.background:
        raise unsupported("background", "background responses are not supported")
    tools = _tools(body.tools)
    choice = body.tool_choice
    if isinstance(choice, RNamedChoice):
        choice = {"name": choice.name}
    rendered_tools, mode, forced = plan_tools(service, tools, choice)
    reasoning = Reasoning.of_effort(body.reasoning.effort if body.reasoning else None)
    images = Images()
    messages = template_messages(body.instructions, body.input, images)
    text, ids, spans = service.render_chat(messages, rendered_tools, reasoning.template_vars(), images)
    fmt = body.text.format if body.text else None
    if forced:
        processors = tool_constraint(service, tools, forced)
    else:
        processors = format_constraint(service, fmt, "text.format")
    processors += reasoning.processors(service, text, "reasoning")
    job = Job(
        endpoint="responses",
        prompt_ids=ids,
        images=spans,
        max_tokens=body.max_output_tokens,
        sampling=service.sampling({"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed}),
        processors=processors,
        parser=service.output_parser(mode == "auto", text),
        forced_calls=forced,
        skip_special=service.skip_special(mode == "auto"),
        client=body.user or body.safety_identifier,
        owner=owner,
        logprobs=body.top_logprobs,
    )
    echo = {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "temperature": job.sampling.temperature,
        "top_p": job.sampling.top_p,
        "tool_choice": _choice_json(body.tool_choice),
        "tools": [{"type": "function", "strict": False, **t} for t in tools],
        "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
        "truncation": body.truncation or "disabled",
        "store": False,
        "reasoning": msgspec.to_builtins(body.reasoning) if body.reasoning else None,
        "user": body.user,
    }
    return job, echo


def _choice_json(choice: Any) -> Any:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def _usage(job: Job) -> dict[str, Any]:
    r = job.result
    return {
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {"cached_tokens": r.cached_tokens},
        "output_tokens": r.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": r.reasoning_tokens or 0},
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


def _envelope(service: Service, job: Job, echo: dict[str, Any], status: str, output: list[dict[str, Any]]) -> dict:
    body = {
        "id": f"resp_{job.id}",
        "object": "response",
        "created_at": job.created,
        "status": status,
        "model": service.name,
        "output": output,
        "error": None,
        "incomplete_details": None,
        **echo,
        "usage": None,
    }
    if status in ("completed", "incomplete"):
        body["usage"] = _usage(job)
        if job.result.finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call: Any, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


def response_body(service: Service, job: Job, echo: dict[str, Any]) -> dict[str, Any]:
    r = job.result
    output = []
    if r.reasoning:
        output.append(_reasoning_item(_item_id("rs"), r.reasoning))
    if r.content or not (r.tool_calls or r.reasoning):
        output.append(_message_item(_item_id("msg"), r.content))
    output += [_call_item(_item_id("fc"), c) for c in r.tool_calls]
    return _envelope(service, job, echo, "completed", output)


async def responses_stream(service: Service, job: Job, handle: Any, echo: dict[str, Any]) -> AsyncIterator[bytes]:
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        return sse({"type": kind, "sequence_number": sequence - 1, **fields}, kind)

    output: list[dict[str, Any]] = []
    yield event("response.created", response=_envelope(service, job, echo, "in_progress", []))
    yield event("response.in_progress", response=_envelope(service, job, echo, "in_progress", []))
    open_kind: str | None = None
    item_id, text = "", ""

    def close() -> list[bytes]:
        nonlocal open_kind
        out = []
        index = len(output)
        if open_kind == "content":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            common = {"item_id": item_id, "output_index": index, "content_index": 0}
            out.append(event("response.output_text.done", **common, text=text, logprobs=[]))
            out.append(event("response.content_part.done", **common, part=part))
            output.append(_message_item(item_id, text))
            out.append(event("response.output_item.done", output_index=index, item=output[-1]))
        elif open_kind == "reasoning":
            common = {"item_id": item_id, "output_index": index, "content_index": 0}
            out.append(event("response.reasoning_text.done", **common, text=text))
            output.append(_reasoning_item(item_id, text))
            out.append(event("response.output_item.done", output_index=index, item=output[-1]))
        open_kind = None
        return out

    async for piece in service.stream(job, handle):
        if piece.kind == "tool_call":
            for chunk in close():
                yield chunk
            index, call_id = len(output), _item_id("fc")
            yield event(
                "response.output_item.added", output_index=index, item=_call_item(call_id, piece.call, "in_progress")
            )
            yield event(
                "response.function_call_arguments.delta",
                item_id=call_id,
                output_index=index,
                delta=piece.call.arguments,
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=call_id,
                output_index=index,
                name=piece.call.name,
                arguments=piece.call.arguments,
            )
            output.append(_call_item(call_id, piece.call))
            yield event("response.output_item.done", output_index=index, item=output[-1])
            continue
        if not piece.text:
            continue
        index = len(output)
        if piece.kind != open_kind:
            for chunk in close():
                yield chunk
            open_kind, text = piece.kind, ""
            if piece.kind == "content":
                item_id = _item_id("msg")
                yield event(
                    "response.output_item.added", output_index=index, item=_message_item(item_id, "", "in_progress")
                )
                yield event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            else:
                item_id = _item_id("rs")
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={"type": "reasoning", "id": item_id, "summary": [], "content": []},
                )
        text += piece.text
        name = "response.output_text.delta" if piece.kind == "content" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if piece.kind == "content" else {}
        yield event(name, item_id=item_id, output_index=index, content_index=0, delta=piece.text, **extra)
    for chunk in close():
        yield chunk
    final = _envelope(service, job, echo, "completed", output)
    receipt = service.receipt(job)
    if receipt is not None:
        final["receipt"] = receipt
    name = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield event(name, response=final)
