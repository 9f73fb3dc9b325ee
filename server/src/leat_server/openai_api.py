"""OpenAI Chat Completions and Completions: request bodies to jobs, results to response bodies and SSE chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from leat_server import constrained, fim
from leat_server.errors import APIError, bad_request, unsupported
from leat_server.images import Images
from leat_server.reasoning import Reasoning
from leat_server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ChatReasoning,
    CompletionRequest,
    Guided,
    ImageURLPart,
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    NamedToolChoice,
    RefusalPart,
    Sampling,
    TextPart,
)
from leat_server.service import Job, Service, TokenLogprob
from leat_server.token_rules import TokenRules

MAX_STOPS = 16
MAX_CHOICES = 16  # `n`, and `n` times the prompts of a completions batch


def sampling_fields(body: Sampling, index: int = 0) -> dict[str, Any]:
    """The body's sampling fields (those the loaded stages declare were added to its struct), with vLLM's
    ``repetition_penalty`` standing for ``repeat_penalty`` when that is left out; choice ``index`` of ``n`` samples
    with the seed plus ``index`` (a seed gives the same ``n`` choices each time, and they differ)."""
    fields = {name: getattr(body, name) for name in body.__struct_fields__}
    if fields.get("repeat_penalty") is None:
        fields["repeat_penalty"] = body.repetition_penalty
    fields["seed"] = choice_seed(fields.get("seed"), index)
    return fields


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request's: the request's plus the index (None and -1, random, stay so)."""
    return (seed + index) % 2**64 if index and seed not in (None, -1) else seed


def stop_list(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"{param}: at most {MAX_STOPS} stop strings", param)
    return [s for s in stops if s]


def check_common(service: Service, body: Sampling, prompts: int = 1) -> None:
    if body.n * prompts > MAX_CHOICES:
        raise bad_request(f"n times the prompts must be at most {MAX_CHOICES}, not {body.n * prompts}", "n")
    if body.n * prompts > 1 and body.session is not None:
        raise unsupported("n", "a session continues one conversation: ask for one choice of one prompt")
    if body.n * prompts > 1 and service.receipts is not None:
        raise unsupported("n", "a signed receipt covers one choice: ask for each separately")


# --- messages -------------------------------------------------------------------------------------------------


def message_text(content: Any, where: str, images: Images) -> str:
    """A message's content as text; each image part becomes a marker, its bytes kept in ``images``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            parts.append(part.text)
        elif isinstance(part, RefusalPart):
            parts.append(part.refusal)
        elif isinstance(part, ImageURLPart):
            parts.append(images.url(part.image_url.get("url"), f"{where}.content[{j}]"))
        else:
            kind = type(part).__name__.removesuffix("Part").lower()
            raise unsupported(
                f"{where}.content[{j}]", f"{kind} input is not supported; this server takes text and images"
            )
    return "".join(parts)


def parse_arguments(arguments: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        raise bad_request(f"{where}: arguments are not valid JSON ({e})", where) from None
    if not isinstance(value, dict):
        raise bad_request(f"{where}: arguments must be a JSON object", where)
    return value


def template_messages(messages: list[ChatMessage], images: Images) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them: string content (image parts' markers in it; their bytes in
    ``images``), tool-call arguments as objects."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": message_text(m.content, where, images)}
        if m.name:
            entry["name"] = m.name
        if m.tool_calls:
            if role != "assistant":
                raise bad_request(f"{where}: only assistant messages carry tool_calls", f"{where}.tool_calls")
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": parse_arguments(
                            c.function.arguments, f"{where}.tool_calls[{j}].function.arguments"
                        ),
                    },
                }
                for j, c in enumerate(m.tool_calls)
            ]
        if role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"{where}: a tool message needs tool_call_id", f"{where}.tool_call_id")
            entry["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            entry["reasoning_content"] = m.reasoning_content
        out.append(entry)
    return out


def token_controls(service: Service, body: Sampling, max_tokens: int | None) -> tuple[list, frozenset[int]]:
    """vLLM's token-level controls: the processor of ``allowed_token_ids`` and ``min_tokens`` (none when neither is
    asked for), and the ``stop_token_ids``."""
    vocab = service.model.architecture.vocab_size
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = getattr(body, name)
        if ids is not None and not all(0 <= t < vocab for t in ids):
            raise bad_request(f"{name}: token ids must be in 0..{vocab - 1}", name)
    if body.allowed_token_ids is not None and not body.allowed_token_ids:
        raise bad_request("allowed_token_ids is empty: nothing could be sampled", "allowed_token_ids")
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({body.min_tokens}) is over max_tokens ({max_tokens})", "min_tokens")
    stops = frozenset(body.stop_token_ids or ())
    if body.allowed_token_ids is None and not body.min_tokens:
        return [], stops
    if not service.supports("processors"):
        raise unsupported("min_tokens", "token controls need per-request logits processors, which this engine lacks")
    banned = sorted(service.tokenizer.eog_ids | stops) if body.min_tokens else []
    return [TokenRules(body.allowed_token_ids, banned, body.min_tokens)], stops


def prefilled(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation ends in an assistant's message that its answer continues (a prefill: the assistant's
    text so far, no tool call)."""
    return bool(messages) and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")


def template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {k: v for k, v in t.items() if v is not None}} for t in tools]


def plan_tools(
    service: Service,
    tools: list[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
    param: str = "tool_choice",
) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    """(tools for the template, mode, forced) where mode is none/auto/forced and forced is "any" or a tool name.

    ``tools`` are ``{"name", "description", "parameters"}``; ``choice`` is "none"/"auto"/"required" or a tool name
    wrapped as {"name": ...}.
    """
    if choice is not None and isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise bad_request(f"{param} must be 'none', 'auto', 'required' or a named function, not {choice!r}", param)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request(f"{param} asks for a tool call but no tools were given", param)
        return None, "none", None
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two tools share a name", "tools")
    choice = choice or "auto"
    if choice == "none":
        return None, "none", None
    if choice == "auto":
        return template_tools(tools), "auto", None
    if isinstance(choice, dict):
        if choice["name"] not in names:
            raise bad_request(f"{param}: no tool named {choice['name']!r} (tools: {', '.join(names)})", param)
        forced = choice["name"]
    else:
        forced = "any"
    if not service.supports("processors"):
        raise unsupported(
            param,
            "forcing a tool call needs constrained decoding, which this engine does not offer "
            "yet; use tool_choice 'auto'",
        )
    return template_tools(tools), "forced", forced


def tool_constraint(service: Service, tools: list[dict[str, Any]], forced: str) -> list:
    by_name = {t["name"]: t.get("parameters") or {"type": "object"} for t in tools}
    if forced == "any":
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, params in by_name.items()
            ]
        }
    else:
        schema = by_name[forced]
    return [constrained.processor(service, schema, "tool_choice")]


def formats_json(fmt: Any) -> bool:
    """Whether a ``response_format`` (or Responses' ``text.format``) asks for JSON."""
    return fmt is not None and type(fmt).__name__ not in ("TextFormat", "RTextFormatText")


def format_constraint(service: Service, fmt: Any, param: str) -> list:
    if not formats_json(fmt):
        return []
    if not service.supports("processors"):
        raise unsupported(param, "structured output needs constrained decoding, which this engine does not offer yet")
    if isinstance(fmt, JSONObjectFormat) or type(fmt).__name__ == "RTextFormatJSONObject":
        return [constrained.processor(service, {"type": "object"}, param)]
    schema = fmt.json_schema.schema if isinstance(fmt, JSONSchemaResponseFormat) else fmt.schema
    return [constrained.processor(service, schema or {}, param)]


def guided_constraint(service: Service, body: Guided) -> list:
    """vLLM's guided decoding: ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (GBNF), or
    the same as parts of ``structured_outputs``, and llama-server's ``grammar``; at most one of them, and not beside
    a JSON ``response_format``."""
    parts = body.structured_outputs
    chosen = [
        (name, kind, value)
        for name, kind, value in (
            ("guided_json", "json", body.guided_json),
            ("guided_regex", "regex", body.guided_regex),
            ("guided_choice", "choice", body.guided_choice),
            ("guided_grammar", "grammar", body.guided_grammar),
            ("grammar", "grammar", body.grammar),
            *(
                (f"structured_outputs.{kind}", kind, getattr(parts, kind))
                for kind in (("json", "regex", "choice", "grammar") if parts is not None else ())
            ),
        )
        if value is not None
    ]
    if not chosen:
        return []
    if len(chosen) > 1 or formats_json(body.response_format):
        names = [name for name, _, _ in chosen] + (["response_format"] if len(chosen) == 1 else [])
        raise bad_request(f"give one way to constrain the output, not {' and '.join(names)}", chosen[0][0])
    name, kind, value = chosen[0]
    if not service.supports("processors"):
        raise unsupported(name, "guided decoding needs constrained decoding, which this engine does not offer yet")
    if kind == "json" and isinstance(value, str):  # vLLM takes the schema as a JSON text too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"{name}: not valid JSON ({e})", name) from None
    return [constrained.processor(service, value, name, kind)]


# --- chat -------------------------------------------------------------------------------------------------------


def chat_jobs(service: Service, body: ChatCompletionRequest, owner: str | None) -> list[Job]:
    """The body's ``n`` choices, each a job of its own (its own constraint, its own seed)."""
    check_common(service, body)
    return [chat_job(service, body, owner, index) for index in range(body.n)]


def chat_job(service: Service, body: ChatCompletionRequest, owner: str | None, index: int = 0) -> Job:
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(body, name) is not None:
            raise unsupported(name, "not supported by this server")
    if body.modalities and set(body.modalities) - {"text"}:
        raise unsupported("modalities", "only text output is supported")
    if body.functions is not None or body.function_call is not None:
        raise unsupported("functions", "the legacy functions API is not supported; use tools and tool_choice")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if not body.messages:
        raise bad_request("messages must hold at least one message", "messages")
    tools = [
        {"name": t.function.name, "description": t.function.description, "parameters": t.function.parameters}
        for t in body.tools or []
    ]
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = {"name": choice.function.name}
    if formats_json(body.response_format) and choice not in (None, "none", "auto"):
        raise bad_request("response_format cannot be combined with a forced tool_choice", "response_format")
    template_tools_, mode, forced = plan_tools(service, tools, choice)
    asked = body.reasoning or ChatReasoning()
    if body.reasoning_effort is not None and asked.effort is not None and body.reasoning_effort != asked.effort:
        raise bad_request("reasoning_effort and reasoning.effort differ; send one", "reasoning_effort")
    reasoning = Reasoning.of_effort(body.reasoning_effort or asked.effort, asked.max_tokens, asked.enabled)
    extra = reasoning.template_vars() | dict(body.chat_template_kwargs or {})
    images = Images()
    messages = template_messages(body.messages, images)
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
        )
    # vLLM's flags; without them a last assistant message is continued, as llama-server does
    final = body.continue_final_message or (body.add_generation_prompt is None and prefilled(messages))
    opened = body.add_generation_prompt is not False
    text, ids, spans = service.render_chat(messages, template_tools_, extra, images, opened, final)
    processors = service.logit_bias(body.logit_bias) + reasoning.processors(service, text, "reasoning")
    guided = guided_constraint(service, body)
    if forced and guided:
        raise bad_request("guided decoding cannot be combined with a forced tool_choice", "tool_choice")
    if forced:
        processors += tool_constraint(service, tools, forced)
    else:
        processors += guided or format_constraint(service, body.response_format, "response_format")
    max_tokens = body.max_completion_tokens or body.max_tokens
    controls, stop_ids = token_controls(service, body, max_tokens)
    return Job(
        endpoint="chat",
        prompt_ids=ids,
        images=spans,
        max_tokens=max_tokens,
        stop_ids=stop_ids,
        include_stop=body.include_stop_str_in_output,
        sampling=service.sampling(sampling_fields(body, index)),
        stop=stop_list(body.stop),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        ignore_eos=body.ignore_eos,
        processors=processors + controls,
        parser=service.output_parser(mode == "auto", text),
        forced_calls=forced,
        skip_special=service.skip_special(mode == "auto") and body.skip_special_tokens,
        client=body.user,
        session=body.session,
        owner=owner,
    )


def tool_call_json(call: Any, index: int | None = None) -> dict[str, Any]:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


def logprob_json(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.text,
        "logprob": lp.logprob,
        "bytes": list(lp.text.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for _, t, v in lp.top],
    }


def usage_json(jobs: Job | list[Job]) -> dict[str, Any]:
    """Usage of a response's choices: each distinct prompt's tokens once (n choices of one prompt share it), the
    completions' tokens summed."""
    jobs = jobs if isinstance(jobs, list) else [jobs]
    prompts = {tuple(j.prompt_ids): j.result for j in jobs}.values()
    prompt = sum(r.prompt_tokens for r in prompts)
    completion = sum(j.result.completion_tokens for j in jobs)
    reasoning = sum(j.result.reasoning_tokens or 0 for j in jobs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in prompts)},
    } | ({"completion_tokens_details": {"reasoning_tokens": reasoning}} if reasoning else {})


def chat_choice(job: Job, index: int) -> dict[str, Any]:
    r = job.result
    message: dict[str, Any] = {"role": "assistant", "content": r.content if (r.content or not r.tool_calls) else None}
    if r.reasoning:
        message["reasoning_content"] = r.reasoning
    if r.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in r.tool_calls]
    logprobs = {"content": [logprob_json(lp) for lp in r.logprobs]} if job.logprobs is not None else None
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": r.finish_reason}


def chat_body(service: Service, jobs: list[Job]) -> dict[str, Any]:
    job = jobs[0]
    return {
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion",
        "created": job.created,
        "model": service.name,
        "choices": [chat_choice(j, i) for i, j in enumerate(jobs)],
        "usage": usage_json(jobs),
        "system_fingerprint": service.fingerprint,
    }


async def chat_stream(
    service: Service, jobs: list[Job], handles: list[Any], include_usage: bool
) -> AsyncIterator[bytes]:
    job = jobs[0]

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: list | None = None, index: int = 0) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = {"content": [logprob_json(lp) for lp in logprobs]}
        body = {
            "id": f"chatcmpl-{job.id}",
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": service.name,
            "system_fingerprint": service.fingerprint,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    for index in range(len(jobs)):
        yield chunk({"role": "assistant", "content": ""}, index=index)
    calls = [0] * len(jobs)
    try:
        async for index, piece in service.stream_all(jobs, handles):
            logprobs = piece.logprobs if job.logprobs is not None else None
            if piece.kind == "content":
                yield chunk({"content": piece.text}, logprobs=logprobs, index=index)
            elif piece.kind == "reasoning":
                yield chunk({"reasoning_content": piece.text}, logprobs=logprobs, index=index)
            else:
                yield chunk({"tool_calls": [tool_call_json(piece.call, calls[index])]}, logprobs=logprobs, index=index)
                calls[index] += 1
    except APIError as e:
        yield sse(e.body())
        yield b"data: [DONE]\n\n"
        return
    for index, done in enumerate(jobs[:-1]):
        yield chunk({}, done.result.finish_reason, index=index)
    final = {
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": service.name,
        "system_fingerprint": service.fingerprint,
        "choices": [
            {"index": len(jobs) - 1, "delta": {}, "logprobs": None, "finish_reason": jobs[-1].result.finish_reason}
        ],
    }
    for data in _stream_end(service, jobs, {**final, "usage": None} if include_usage else final, include_usage):
        yield data


def sse(body: dict[str, Any], event: str | None = None) -> bytes:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + b"data: " + data.encode() + b"\n\n"


# --- completions --------------------------------------------------------------------------------------------------


def completion_jobs(service: Service, body: CompletionRequest, owner: str | None) -> tuple[list[Job], list[str]]:
    """The body's choices: ``n`` of each of its prompts (a text, token ids, or a batch of them), prompt by prompt,
    each a job of its own; and the text each choice's answer begins with (its prompt, with ``echo``)."""
    prompts: list[Any] = [body.prompt]
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list)):
        prompts = list(body.prompt)
        if not all(isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompts):
            raise bad_request("prompt: give text, a list of token ids, or a list of either", "prompt")
    elif isinstance(body.prompt, list) and not all(isinstance(t, int) for t in body.prompt):
        raise bad_request("prompt: give text, a list of token ids, or a list of either", "prompt")
    check_common(service, body, len(prompts))
    made = [completion_job(service, body, owner, prompt, index) for prompt in prompts for index in range(body.n)]
    return [job for job, _ in made], [echo for _, echo in made]


def completion_job(
    service: Service, body: CompletionRequest, owner: str | None, prompt: Any, index: int = 0
) -> tuple[Job, str]:
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    if body.suffix:  # fill in the middle, between the prompt and the suffix
        if body.echo or not isinstance(prompt, str):
            raise bad_request("suffix needs a text prompt (the code before it) and no echo", "suffix")
        ids, text = fim.prompt(service, prompt, body.suffix, n_predict=body.max_tokens or -1), ""
    elif isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        ids = service.tokenizer.encode(prompt, add_special=True, parse_special=True)
        text = prompt
    else:
        ids = list(prompt)
        if not ids:
            raise bad_request("prompt is empty", "prompt")
        vocab = service.model.architecture.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise bad_request(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        text = service.tokenizer.decode(ids) if body.echo else ""
    processors = service.logit_bias(body.logit_bias) + (
        guided_constraint(service, body) or format_constraint(service, body.response_format, "response_format")
    )
    prompt_logprobs = None
    if body.echo and body.logprobs is not None:  # the prompt's own logprobs (the first token has none)
        scores = service.engine.score([ids], body.logprobs)[0]
        first = TokenLogprob(ids[0], service.piece(ids[0]), None)
        prompt_logprobs = [first] + [
            TokenLogprob(t, service.piece(t), lp, [(u, service.piece(u), v) for u, v in top])
            for t, (lp, top) in zip(ids[1:], scores)
        ]
    controls, stop_ids = token_controls(service, body, body.max_tokens)
    job = Job(
        endpoint="completions",
        prompt_ids=ids,
        prompt_logprobs=prompt_logprobs,
        max_tokens=body.max_tokens,
        sampling=service.sampling(sampling_fields(body, index)),
        stop=stop_list(body.stop),
        stop_ids=stop_ids,
        include_stop=body.include_stop_str_in_output,
        skip_special=body.skip_special_tokens,
        logprobs=body.logprobs,
        ignore_eos=body.ignore_eos,
        processors=processors + controls,
        client=body.user,
        session=body.session,
        owner=owner,
    )
    return job, text if body.echo else ""


def completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's logprobs of a completion's tokens; an echoed prompt's first token has none (``logprob`` None)."""
    offsets, at = [], offset
    for lp in lps:
        offsets.append(at)
        at += len(lp.text)
    return {
        "tokens": [lp.text for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t: v for _, t, v in lp.top} if lp.logprob is not None else None for lp in lps],
        "text_offset": offsets,
    }


def completion_choice(job: Job, echo: str, index: int) -> dict[str, Any]:
    r = job.result
    logprobs = completion_logprobs(r.logprobs, len(echo)) if job.logprobs is not None else None
    if logprobs is not None and job.prompt_logprobs is not None:  # the echoed prompt's first
        prompt = completion_logprobs(job.prompt_logprobs, 0)
        logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
    return {"index": index, "text": echo + r.content, "logprobs": logprobs, "finish_reason": r.finish_reason}


def completion_body(service: Service, jobs: list[Job], echoes: list[str]) -> dict[str, Any]:
    job = jobs[0]
    return {
        "id": f"cmpl-{job.id}",
        "object": "text_completion",
        "created": job.created,
        "model": service.name,
        "choices": [completion_choice(j, echo, i) for i, (j, echo) in enumerate(zip(jobs, echoes, strict=True))],
        "usage": usage_json(jobs),
        "system_fingerprint": service.fingerprint,
    }


async def completion_stream(
    service: Service, jobs: list[Job], handles: list[Any], echoes: list[str], include_usage: bool
):
    job = jobs[0]

    def chunk(text: str, finish: str | None = None, logprobs: dict | None = None, index: int = 0) -> dict[str, Any]:
        return {
            "id": f"cmpl-{job.id}",
            "object": "text_completion",
            "created": job.created,
            "model": service.name,
            "system_fingerprint": service.fingerprint,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }

    for index, (each, echo) in enumerate(zip(jobs, echoes, strict=True)):
        if echo:
            prompt = each.prompt_logprobs
            yield sse(chunk(echo, logprobs=completion_logprobs(prompt, 0) if prompt is not None else None, index=index))
    offsets = [len(echo) for echo in echoes]
    try:
        async for index, piece in service.stream_all(jobs, handles):
            lps = completion_logprobs(piece.logprobs, offsets[index]) if job.logprobs is not None else None
            offsets[index] += len(piece.text)
            if piece.text or lps:
                yield sse(chunk(piece.text, logprobs=lps, index=index))
    except APIError as e:
        yield sse(e.body())
        yield b"data: [DONE]\n\n"
        return
    for index, done in enumerate(jobs[:-1]):
        yield sse(chunk("", done.result.finish_reason, index=index))
    last = chunk("", jobs[-1].result.finish_reason, index=len(jobs) - 1)
    for data in _stream_end(service, jobs, last, include_usage):
        yield data


def _stream_end(service: Service, jobs: list[Job], final: dict, include_usage: bool) -> Iterator[bytes]:
    """A stream's last events: the finishing chunk, with stream_options.include_usage a chunk of usage only
    after it, the receipt (of a one-choice answer) on the last one, then [DONE]."""
    receipt = service.receipt(jobs[0]) if len(jobs) == 1 else None
    if include_usage:
        yield sse(final)
        final = {**final, "choices": [], "usage": usage_json(jobs)}
    if receipt is not None:
        final["receipt"] = receipt
    yield sse(final)
    yield b"data: [DONE]\n\n"
