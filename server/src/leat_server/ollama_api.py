"""Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``), so that tools written for Ollama (its Python and JavaScript clients, and what is built on them)
talk to ``leat serve`` unchanged: newline-delimited JSON streams (streaming is the default, as Ollama's), durations
in nanoseconds, errors as ``{"error": "..."}``.

What maps where: ``options`` are the sampler's fields (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``, and any a sampler plugin adds),
``num_predict`` the token limit and ``stop`` the stop strings; the options that set how Ollama loads a model
(``num_ctx``, ``num_gpu``, ``num_thread``, ...) are the server's to set (``leat serve`` options) and are ignored here;
a sampler Ollama has and leat does not (``typical_p``, ``mirostat``, ``tfs_z``) is a 400 unless at its neutral value.
``format`` is ``"json"`` or a JSON schema (constrained decoding), ``think`` the model's reasoning (out in
``thinking``), ``keep_alive`` 0 with no prompt unloads a model; models are named as ``leat serve`` names them, with or
without Ollama's ``:latest`` tag.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import gguf
import msgspec
from leat.plugins import host as plugin_host
from leat.sampling import fields as sampling_fields
from msgspec import Struct

from leat_server import constrained, fim
from leat_server.errors import APIError, bad_request, unsupported
from leat_server.images import Images, decode
from leat_server.openai_api import logprob_json, plan_tools, prefilled
from leat_server.reasoning import Reasoning
from leat_server.service import Job, Service

LATEST = ":latest"
NDJSON = "application/x-ndjson"
#: Ollama's options that decide how it loads and runs a model, set here by ``leat serve``'s own options: ignored
LOAD_OPTIONS = frozenset(
    [
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "num_thread",
        "numa",
        "num_keep",
        "penalize_newline",
        "embedding_only",
        "rope_frequency_base",
        "rope_frequency_scale",
    ]
)
#: Ollama's samplers that leat has not, and the value at which each does nothing (accepted)
NEUTRAL = {"typical_p": 1.0, "mirostat": 0, "mirostat_tau": None, "mirostat_eta": None, "tfs_z": 1.0}
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "cancelled": "stop"}


class OTool(Struct, forbid_unknown_fields=True):
    function: dict[str, Any]
    type: str = "function"


class OToolCall(Struct, forbid_unknown_fields=True):
    function: dict[str, Any]
    id: str | None = None
    type: str | None = None


class OMessage(Struct, forbid_unknown_fields=True):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None


class Generation(Struct, forbid_unknown_fields=True, kw_only=True):
    """What a chat's and a generation's bodies share."""

    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class ChatRequest(Generation, kw_only=True):
    messages: list[OMessage] | None = None
    tools: list[OTool] | None = None


class GenerateRequest(Generation, kw_only=True):
    prompt: str | None = None
    suffix: str | None = None
    images: list[str] | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False


class EmbedRequest(Struct, forbid_unknown_fields=True):
    model: str
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


class EmbeddingsRequest(Struct, forbid_unknown_fields=True):  # the older single-prompt form
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class ShowRequest(Struct, forbid_unknown_fields=True):
    model: str | None = None
    name: str | None = None  # the older field
    verbose: bool = False


def served_name(names: Any, name: str) -> str:
    """The served model a request's ``model`` means: Ollama's clients may add the ``:latest`` tag."""
    if name.endswith(LATEST) and name not in names and name.removesuffix(LATEST) in names:
        return name.removesuffix(LATEST)
    return name


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def line(body: dict[str, Any]) -> bytes:
    return msgspec.json.encode(body) + b"\n"


def unloading(keep_alive: Any) -> bool:
    """Whether ``keep_alive`` asks for the model to go now (0, "0", "0s", ...)."""
    if isinstance(keep_alive, int | float):
        return keep_alive == 0
    return isinstance(keep_alive, str) and keep_alive.strip().rstrip("smh") in ("0", "0.0")


# --- options ------------------------------------------------------------------------------------------------------


def options(service: Service, given: dict[str, Any] | None) -> tuple[dict[str, Any], int | None, list[str]]:
    """Ollama's ``options`` as (the sampler's fields, the token limit, the stop strings)."""
    fields: dict[str, Any] = {}
    limit, stops = None, []
    known = set(sampling_fields(plugin_host()))
    for key, value in (given or {}).items():
        param = f"options.{key}"
        if value is None or key in LOAD_OPTIONS:
            continue
        if key == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad_request(f"{param} must be an integer", param)
            limit = value if value >= 0 else None  # -1: no limit; -2: until the context is full
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise bad_request(f"{param} must be a string or a list of strings", param)
            stops = [s for s in stops if s]
        elif key in NEUTRAL:
            if NEUTRAL[key] is not None and value != NEUTRAL[key]:
                raise unsupported(param, f"this server has no {key} sampler; leave it at {NEUTRAL[key]} or out")
        elif key in known:
            fields[key] = value
        else:
            raise bad_request(f"{param}: unknown option", param)
    return fields, limit, stops


def _format(service: Service, fmt: str | dict[str, Any] | None) -> list:
    if fmt is None or fmt == "":
        return []
    if isinstance(fmt, str) and fmt != "json":
        raise bad_request('format must be "json" or a JSON schema', "format")
    if not service.supports("processors"):
        raise unsupported(
            "format", "structured output needs constrained decoding, which this engine does not offer yet"
        )
    return [constrained.processor(service, {"type": "object"} if fmt == "json" else fmt, "format")]


def _logprobs(body: Generation) -> int | None:
    """The job's logprobs: None for none, else how many alternatives a token."""
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise bad_request("top_logprobs must be in 0..20", "top_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _reasoning(think: bool | str | None) -> Reasoning:
    if think is None:
        return Reasoning()
    if isinstance(think, str):
        if think not in ("low", "medium", "high"):
            raise bad_request('think must be true, false, "low", "medium" or "high"', "think")
        return Reasoning.of_effort(think, enabled=True)
    return Reasoning(enabled=think)


# --- jobs ---------------------------------------------------------------------------------------------------------


def _images(images: Images, given: list[str] | None, param: str) -> str:
    """Markers for a message's base64 images (their bytes kept in ``images``), before its text as Ollama puts them."""
    return "".join(images.add(decode(data, f"{param}[{j}]"), param) for j, data in enumerate(given or []))


def template_messages(messages: list[OMessage], images: Images) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"{where}.role must be system, user, assistant or tool, not {m.role!r}", f"{where}.role")
        entry: dict[str, Any] = {"role": m.role, "content": _images(images, m.images, f"{where}.images") + m.content}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"{where}: only assistant messages carry tool_calls", f"{where}.tool_calls")
            calls = []
            for j, call in enumerate(m.tool_calls):
                name, arguments = call.function.get("name"), call.function.get("arguments", {})
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    raise bad_request(
                        f"{where}.tool_calls[{j}].function needs a name and arguments (an object)",
                        f"{where}.tool_calls[{j}].function",
                    )
                call_id = call.id or f"call_{i}_{j}"
                calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            entry["tool_calls"] = calls
        if m.role == "tool" and m.tool_name:
            entry["name"] = m.tool_name
        if m.thinking:
            entry["reasoning_content"] = m.thinking
        out.append(entry)
    return out


def _tools(tools: list[OTool] | None) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools or []):
        if t.type != "function" or not isinstance(t.function.get("name"), str):
            raise bad_request(f"tools[{i}] must be a function with a name", f"tools[{i}]")
        f = t.function
        out.append({"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")})
    return out


def _job(
    service: Service, body: Generation, owner: str | None, reasoning: Reasoning, prompt: tuple, tools_active: bool
) -> Job:
    """The engine's job for a chat or a generation whose prompt is ``(text, ids, image spans)``."""
    fields, limit, stops = options(service, body.options)
    text, ids, spans = prompt
    return Job(
        endpoint="ollama_chat" if isinstance(body, ChatRequest) else "ollama_generate",
        prompt_ids=ids,
        images=spans,
        max_tokens=limit,
        sampling=service.sampling(fields),
        stop=stops,
        logprobs=_logprobs(body),
        processors=_format(service, body.format) + reasoning.processors(service, text, "think"),
        parser=service.output_parser(tools_active, text),
        skip_special=service.skip_special(tools_active),
        owner=owner,
    )


def chat_job(service: Service, body: ChatRequest, owner: str | None) -> Job:
    rendered_tools, mode, _ = plan_tools(service, _tools(body.tools), None)
    reasoning = _reasoning(body.think)
    images = Images()
    messages = template_messages(body.messages or [], images)
    extra = reasoning.template_vars()
    prompt = service.render_chat(messages, rendered_tools, extra, images, continue_final=prefilled(messages))
    return _job(service, body, owner, reasoning, prompt, mode == "auto")


def generate_job(service: Service, body: GenerateRequest, owner: str | None) -> Job:
    if body.template:
        raise unsupported("template", "the model's own chat template is used; send raw: true with a formatted prompt")
    reasoning = _reasoning(body.think)
    prompt = body.prompt or ""
    if body.suffix:  # fill in the middle, between the prompt and the suffix
        if body.images or body.system or body.context:
            raise unsupported("suffix", "a fill-in-the-middle prompt takes no images, system or context")
        ids = fim.prompt(service, prompt, body.suffix)
        return _job(service, body, owner, reasoning, ("", ids, []), False)
    if body.raw:
        if body.images or body.system:
            raise unsupported("raw", "a raw prompt takes no images or system; put them in the prompt")
        text = prompt
        ids = service.tokenizer.encode(prompt, add_special=not body.context, parse_special=True)
        spans: list[Any] = []
    else:
        images = Images()
        messages = [{"role": "system", "content": body.system}] if body.system else []
        messages.append({"role": "user", "content": _images(images, body.images, "images") + prompt})
        text, ids, spans = service.render_chat(messages, None, reasoning.template_vars(), images)
        if body.context and ids and ids[0] == service.tokenizer.bos_id:
            ids = ids[1:]  # the context begins the sequence already
    if body.context:
        vocab = service.model.architecture.vocab_size
        if not all(0 <= t < vocab for t in body.context):
            raise bad_request(f"context token ids must be in 0..{vocab - 1}", "context")
        if spans:
            raise unsupported("images", "images beside a context are not supported; send the conversation to /api/chat")
        ids = list(body.context) + ids
    if not ids:
        raise bad_request("prompt is empty", "prompt")
    return _job(service, body, owner, reasoning, (text, ids, spans), False)


# --- answers ------------------------------------------------------------------------------------------------------


def _stats(job: Job) -> dict[str, Any]:
    r = job.result
    total = time.perf_counter() - job.started
    first = r.timings.get("ttft_seconds", 0.0)
    generating = max(0.0, r.timings.get("total_seconds", total) - first)
    return {
        "done": True,
        "done_reason": DONE_REASONS.get(r.finish_reason, "stop"),
        "total_duration": int(total * 1e9),
        "load_duration": 0,
        "prompt_eval_count": r.prompt_tokens - r.cached_tokens,
        "prompt_eval_duration": int(first * 1e9),
        "eval_count": r.completion_tokens,
        "eval_duration": int(generating * 1e9),
    }


def _call(call: Any) -> dict[str, Any]:
    return {"function": {"name": call.name, "arguments": msgspec.json.decode(call.arguments or "{}")}}


def chat_body(model: str, job: Job) -> dict[str, Any]:
    r = job.result
    message: dict[str, Any] = {"role": "assistant", "content": r.content}
    if r.reasoning:
        message["thinking"] = r.reasoning
    if r.tool_calls:
        message["tool_calls"] = [_call(c) for c in r.tool_calls]
    body = {"model": model, "created_at": now(), "message": message, **_stats(job)}
    if job.logprobs is not None:
        body["logprobs"] = [logprob_json(lp) for lp in r.logprobs]
    return body


async def chat_stream(model: str, service: Service, job: Job, handle: Any) -> AsyncIterator[bytes]:
    async for piece in service.stream(job, handle):
        if piece.kind == "tool_call":
            message = {"role": "assistant", "content": "", "tool_calls": [_call(piece.call)]}
        elif not (piece.text or piece.logprobs):
            continue
        elif piece.kind == "reasoning":
            message = {"role": "assistant", "content": "", "thinking": piece.text}
        else:
            message = {"role": "assistant", "content": piece.text}
        chunk = {"model": model, "created_at": now(), "message": message, "done": False}
        if job.logprobs is not None:
            chunk["logprobs"] = [logprob_json(lp) for lp in piece.logprobs]
        yield line(chunk)
    end = {"role": "assistant", "content": ""}
    yield line({"model": model, "created_at": now(), "message": end, **_stats(job)})


def generate_body(model: str, job: Job) -> dict[str, Any]:
    r = job.result
    body: dict[str, Any] = {"model": model, "created_at": now(), "response": r.content}
    if r.reasoning:
        body["thinking"] = r.reasoning
    if job.logprobs is not None:
        body["logprobs"] = [logprob_json(lp) for lp in r.logprobs]
    return body | _stats(job) | {"context": job.prompt_ids + r.token_ids}


async def generate_stream(model: str, service: Service, job: Job, handle: Any) -> AsyncIterator[bytes]:
    async for piece in service.stream(job, handle):
        if not (piece.text or piece.logprobs):
            continue
        field = "thinking" if piece.kind == "reasoning" else "response"
        chunk = {"model": model, "created_at": now(), "response": "", field: piece.text, "done": False}
        if job.logprobs is not None:
            chunk["logprobs"] = [logprob_json(lp) for lp in piece.logprobs]
        yield line(chunk)
    final = {"model": model, "created_at": now(), "response": ""} | _stats(job)
    yield line(final | {"context": job.prompt_ids + job.result.token_ids})


def empty_answer(model: str, endpoint: str, reason: str) -> dict[str, Any]:
    """What Ollama answers a request with no prompt: the model loaded (or unloaded), nothing generated."""
    body: dict[str, Any] = {"model": model, "created_at": now(), "done": True, "done_reason": reason}
    if endpoint == "chat":
        return body | {"message": {"role": "assistant", "content": ""}}
    return body | {"response": ""}


# --- embeddings -----------------------------------------------------------------------------------------------------


def embed(service: Service, body: EmbedRequest, owner: str | None) -> dict[str, Any]:
    if body.dimensions is not None:
        raise unsupported("dimensions", "embeddings have the model's width; they are not shortened")
    options(service, body.options)  # checked, though no option changes an embedding
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise bad_request("input is empty; send a text or a list of texts", "input")
    prompts = []
    for i, text in enumerate(texts):
        ids = service.tokenizer.encode(text, add_special=True)
        if not ids:
            raise bad_request(f"input[{i}] is empty", "input")
        if len(ids) > service.max_context:
            if not body.truncate:
                raise bad_request(
                    f"input[{i}] has {len(ids)} tokens; the limit is {service.max_context} (truncate: true cuts it)",
                    "input",
                )
            ids = ids[: service.max_context]
        prompts.append(ids)
    started = time.perf_counter()
    vectors = service.engine.embed(prompts)
    return {
        "model": body.model,
        "embeddings": [[float(v) for v in vector] for vector in vectors],
        "total_duration": int((time.perf_counter() - started) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": sum(len(ids) for ids in prompts),
    }


def embeddings(service: Service, body: EmbeddingsRequest, owner: str | None) -> dict[str, Any]:
    answer = embed(service, EmbedRequest(body.model, body.prompt, options=body.options), owner)
    return {"embedding": answer["embeddings"][0]}


# --- models -------------------------------------------------------------------------------------------------------


def details(service: Service | None) -> dict[str, Any]:
    """Ollama's ``details`` of a model: its format, family, parameter count and quantization (once loaded)."""
    out: dict[str, Any] = {"parent_model": "", "format": "gguf"}
    if service is None:
        return out
    file = service.model.file
    sizes: dict[str, int] = {}
    parameters = 0
    for tensor in file.tensors.values():
        count = 1
        for n in tensor.shape:
            count *= int(n)
        parameters += count
        sizes[tensor.qtype.name] = sizes.get(tensor.qtype.name, 0) + count
    file_type = file.metadata.get("general.file_type")
    try:
        quant = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        quant = ""
    quant = quant or max(sizes, key=sizes.__getitem__, default="")
    return out | {
        "family": file.architecture,
        "families": [file.architecture],
        "parameter_size": _count(parameters),
        "quantization_level": quant,
    }


def _count(n: int) -> str:
    """A parameter count as Ollama writes it: 8.0B, 135.0M."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def model_card(entry: Any, running: bool = False) -> dict[str, Any]:
    service = entry.service if entry.state == "loaded" else None
    stamp = entry.loaded_at if entry.loaded_at is not None else time.time()
    size = entry.size or 0
    if service is not None:  # the file's own size and time
        stat = os.stat(service.model.file.path)
        size, stamp = size or stat.st_size, stat.st_mtime
    card: dict[str, Any] = {
        "name": entry.spec.name,
        "model": entry.spec.name,
        "modified_at": datetime.fromtimestamp(stamp, UTC).isoformat(),
        "size": size,
        "details": details(service),
    }
    if running:  # loaded until unloaded (no keep-alive timer): Ollama's "never" expiry
        card |= {"size_vram": 0, "expires_at": "0001-01-01T00:00:00Z", "context_length": service.max_context}
    return card


def show(service: Service, body: ShowRequest, owner: str | None) -> dict[str, Any]:
    file = service.model.file
    info: dict[str, Any] = {}
    for key, value in file.metadata.items():
        if key == "tokenizer.chat_template":
            continue
        if isinstance(value, str | int | float | bool) or value is None:
            info[key] = value
        elif not body.verbose:
            info[key] = None  # long arrays (the vocabulary) only with verbose, as Ollama does
        else:
            info[key] = [v if isinstance(v, str | int | float | bool) else str(v) for v in value]
    template = service.model.chat_template.source or ""
    capabilities = ["completion"]
    if "tools" in template:  # the template renders tools (as Ollama decides)
        capabilities.append("tools")
    if service.format.reasoning:
        capabilities.append("thinking")
    if getattr(service.model, "vision", None) is not None:
        capabilities.append("vision")
    return {
        "modelfile": f"# served by leat\nFROM {file.path}\n",
        "parameters": "",
        "template": template,
        "details": details(service),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": now(),
    }


def error_body(error: APIError) -> dict[str, Any]:
    return {"error": error.message}
