"""The Litestar application: routes, error mapping, and the guard in front of them.

Every handler does its blocking work (decoding, templates, tokenizing, constraints, session calls) on
:class:`~leat_server.workers.Workers` threads, never on the event loop. The OpenAPI schema is Litestar's,
with each POST body's schema generated from its msgspec struct; it is served at ``/openapi.json`` and
under ``/schema``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec
from leat import __version__
from leat.engine import Overloaded, TooLong
from leat.errors import LeatError
from leat.plugins import PluginHost
from leat.plugins import host as plugin_host
from leat.sampling import fields as sampling_fields
from leat.sessions import SessionInUse
from litestar import Litestar, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import OpenAPIMediaType, Reference, RequestBody
from litestar.params import FromPath
from litestar.response import Stream

from leat_server import anthropic_api, embeddings, llamacpp_api, ollama_api, openai_api, rerank, responses_api
from leat_server.errors import APIError, bad_request, from_msgspec
from leat_server.images import Images
from leat_server.models import Lease, Models
from leat_server.requestlog import request_log
from leat_server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    MessagesRequest,
    ModelRequest,
    RerankRequest,
    ResponsesRequest,
    SessionRequest,
    TokenizeRequest,
    with_sampling_fields,
)
from leat_server.security import Guard
from leat_server.service import Job, Service
from leat_server.workers import Workers

log = logging.getLogger("leat_server")
JSON = "application/json"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY = 32 << 20
MAX_DEPTH = 64  # of JSON arrays and objects in a body
SWEEP_SECONDS = 1.0  # between checks of the session store's limits
CLIENT_GONE = 499  # the status a request whose client went away is counted under (nginx's "client closed request")
BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": anthropic_api.CountTokensRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/sessions": SessionRequest,
    "/v1/embeddings": EmbeddingRequest,
    **dict.fromkeys(rerank.PATHS, RerankRequest),
    "/models/load": ModelRequest,
    "/models/unload": ModelRequest,
    "/completion": llamacpp_api.CompletionRequest,
    "/infill": llamacpp_api.InfillRequest,
    "/apply-template": llamacpp_api.ApplyTemplateRequest,
    "/api/chat": ollama_api.ChatRequest,
    "/api/generate": ollama_api.GenerateRequest,
    "/api/embed": ollama_api.EmbedRequest,
    "/api/embeddings": ollama_api.EmbeddingsRequest,
    "/api/show": ollama_api.ShowRequest,
}
SAMPLING_PATHS = ("/v1/chat/completions", "/v1/completions")  # bodies that take every sampler stage's fields


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content=msgspec.json.encode(body), media_type=JSON, status_code=status, headers=headers)


async def _read(request: Request) -> bytes:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"request body over {MAX_BODY >> 20} MiB")
    return raw


def decode(raw: bytes, kind: type) -> Any:
    """A body as ``kind``: 400 for bad JSON, a bad field, nesting deeper than :data:`MAX_DEPTH`, or an integer beyond
    64 bits (msgspec keeps it whole, where the engine link's msgpack and the samplers' numpy cannot carry it)."""
    if not raw.strip():
        raise bad_request("request body is empty; send a JSON object")
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as e:
        raise from_msgspec(e) from None
    except RecursionError:
        body = None
    if body is None or (raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(body) > MAX_DEPTH):
        raise bad_request(f"request body nests arrays and objects deeper than {MAX_DEPTH} levels; flatten it")
    if re.search(rb"\d{19}", raw) and (
        wide := [v for v, _ in _walk(body) if type(v) is int and not -(2**63) <= v < 2**64]
    ):
        raise bad_request(f"the number {wide[0]} is out of range: a request's integers fit in 64 bits")
    return body


def _depth(value: Any) -> int:
    deepest = 0
    for _, depth in _walk(value):
        if depth > MAX_DEPTH:
            return depth
        deepest = max(deepest, depth)
    return deepest


def _walk(value: Any) -> Iterator[tuple[Any, int]]:
    """Every value in ``value`` (a decoded body) and its depth."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        yield item, depth
        if isinstance(item, msgspec.Struct):
            todo += [(getattr(item, f), depth + 1) for f in item.__struct_fields__]
        elif isinstance(item, dict):
            todo += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, (list, tuple)):
            todo += [(v, depth + 1) for v in item]


def _owner(request: Request) -> str | None:
    return request.scope.get("leat.owner")


def as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Overloaded):
        seconds = max(1, math.ceil(exc.retry_after))
        return APIError(429, str(exc), code="overloaded", headers={"Retry-After": str(seconds)})
    if isinstance(exc, SessionInUse):
        return APIError(409, f"{exc}; try again once its request has finished", code="session_in_use")
    if isinstance(exc, TooLong):
        message = str(exc) if str(exc.limit) in str(exc) else f"{exc} (the limit is {exc.limit} tokens)"
        return APIError(400, message, code="context_length_exceeded")
    if isinstance(exc, msgspec.DecodeError):
        return from_msgspec(exc)
    if isinstance(exc, LeatError):
        return APIError(400, str(exc))
    if isinstance(exc, HTTPException):
        return APIError(exc.status_code, str(exc.detail))
    return APIError(500, f"internal error: {type(exc).__name__}; see the server log", type="server_error")


def _error_response(request: Request, exc: Exception) -> Response:
    error = as_api_error(exc)
    if error.status >= 500 and not isinstance(exc, APIError):
        request.logger.exception("request failed", exc_info=exc)
    path = request.url.path
    if path.startswith("/api/"):
        body = ollama_api.error_body(error)
    else:
        body = error.anthropic_body() if path.startswith("/v1/messages") else error.body()
    return _json(body, error.status, error.headers or None)


def _stream(
    lease: Lease, job: Job | list[Job], handle: Any, content: AsyncIterator[bytes], style: str = "openai"
) -> Stream:
    """``content`` as an SSE response (Ollama's ``style``: newline-delimited JSON) that ends with an error event
    instead of a dropped connection when something fails, and whose engine requests (``job`` and ``handle``, or
    lists of them: a request's choices) end with it, however it ends: sent whole, failed, or its client gone
    (Litestar's listener then cancels the sender); its model's lease is released then."""
    service, release = lease.service, lease.keep()
    pairs = list(zip(job, handle, strict=True)) if isinstance(job, list) else [(job, handle)]

    def abandon() -> None:  # a no-op for a request that has ended
        for each, its_handle in pairs:
            service.abandon(each, its_handle)

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in content:
                yield chunk
        except Exception as e:  # the 200 is already sent: report in-band
            error = as_api_error(e)
            if error.status >= 500 and not isinstance(e, APIError):
                log.exception("streamed request failed", exc_info=e)
            if style == "anthropic":
                yield openai_api.sse(error.anthropic_body(), "error")
            elif style == "ollama":
                yield ollama_api.line(ollama_api.error_body(error))
            else:
                yield openai_api.sse(error.body())
                yield b"data: [DONE]\n\n"
        finally:
            abandon()
            await content.aclose()  # the inner generators' clean-up runs now, not when they are garbage-collected
            release()

    async def close() -> None:
        # After the response, however it ended. The sender may have been cancelled before it first pulled the
        # generator (the client gone before the stream began) or while it waited on a slow socket (the generator
        # held at a yield): then nothing else would end the request, or close the generator, but garbage collection.
        abandon()
        await body.aclose()
        release()

    body = guarded()
    media = ollama_api.NDJSON if style == "ollama" else "text/event-stream"
    return Stream(body, media_type=media, headers=SSE_HEADERS, status_code=200, background=BackgroundTask(close))


async def _disconnected(receive: Callable) -> None:
    """Return once the ASGI server reports that the client has gone (``http.disconnect``); the handler has read the
    whole body by then, so nothing else is waiting on ``receive``."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # cannot tell: the request runs to its end, as it would without this watch
        log.exception("watching for a client disconnect failed")
        await asyncio.Event().wait()


def create_app(
    models: Models,
    metrics: Any,
    keys: Any = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    allow_origins: list[str] = (),
) -> Any:
    """The ASGI application serving ``models``: Litestar routes behind the :class:`Guard`."""
    workers = Workers()
    bodies = request_bodies()

    async def prepare(
        request: Request,
        kind: type,
        make: Callable[[Service, Any, str | None], Any],
        name: str | None = None,
        decoded: Any = None,
    ) -> Any:
        """A lease on the model the body names (or ``name``), the body decoded (unless the caller has: ``decoded``),
        and ``make(service, body, owner)`` run on a worker thread: ``(lease, body, made)``."""
        raw, owner = await _read(request), _owner(request)
        lease = await models.acquire(models.route(raw) if name is None else name)

        def work() -> tuple[Any, Any]:
            body = decode(raw, kind) if decoded is None else decoded
            return body, make(lease.service, body, owner)

        try:
            body, made = await workers.run(work)
        except BaseException:
            lease.release()
            raise
        job = made[0] if isinstance(made, tuple) else made
        job = job[0] if isinstance(job, list) else job  # a request's choices: the first's timings
        if isinstance(job, Job):
            request.scope["leat.job"] = job  # its timings for the request log
        return lease, body, made

    async def finish(request: Request, service: Service, job: Job | list[Job], handle: Any) -> None:
        """Run ``job`` (or each of a list, with its ``handle`` of a list) to its end (``job.result``), unless the
        client goes away first: then its engine request is cancelled at once, so the engine frees its slot and KV
        pages at its next step, and the answer is a 499 that only the metrics see. A choice that fails ends the
        others."""
        pairs = list(zip(job, handle, strict=True)) if isinstance(job, list) else [(job, handle)]
        run = asyncio.ensure_future(asyncio.gather(*(service.run(j, h) for j, h in pairs)))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait((run, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not run.done() or run.cancelled() or run.exception() is not None:  # the client went away, the handler
                for j, h in pairs:  # was cancelled, or a choice failed: none goes on (a no-op for one that has ended)
                    service.abandon(j, h)
                run.cancel()
        if run not in done:
            await asyncio.wait((run,))  # its clean-up done
            raise APIError(CLIENT_GONE, "the client closed the connection before the answer was ready")
        run.result()

    async def submit(service: Service, jobs: list[Job]) -> list[Any]:
        """Each of a request's choices to the engine; where one is refused (a full queue) those already taken end."""
        handles: list[Any] = []
        try:
            for job in jobs:
                handles.append(await service.submit(job))
        except BaseException:
            for job, handle in zip(jobs, handles):
                service.abandon(job, handle)
            raise
        return handles

    @get("/", sync_to_thread=False)
    def root() -> Response:
        """What Ollama's root answers (its clients check that the server runs); needs no key."""
        return Response(content="leat is running", media_type="text/plain")

    @get("/health", sync_to_thread=False)
    def health() -> Response:
        stats = models.stats()
        return _json(
            {
                "status": "ok",
                "model": models.default.spec.name,
                "queue_depth": stats.get("queue_depth", 0),
                "running": stats.get("running", 0),
            }
        )

    @get("/metrics", sync_to_thread=False)
    def metrics_page() -> Response:
        return Response(content=metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @get("/v1/models", sync_to_thread=False)
    def list_models() -> Response:
        return _json({"object": "list", "data": [models.card(entry) for entry in models.entries]})

    @get("/v1/models/{model_id:path}", sync_to_thread=False)
    def model(model_id: FromPath[str]) -> Response:
        name = model_id.strip("/")
        entry = models.by_name.get(name)
        if entry is None:
            raise APIError(
                404,
                f"model {name!r} is not served here; known models: {', '.join(models.by_name)}",
                param="model",
                code="model_not_found",
            )
        return _json(models.card(entry))

    @post("/models/load", status_code=200)
    async def load_model(request: Request) -> Response:
        name = decode(await _read(request), ModelRequest).model
        return _json(models.card(await models.load_now(name)))

    @post("/models/unload", status_code=200)
    async def unload_model(request: Request) -> Response:
        name = decode(await _read(request), ModelRequest).model
        return _json(models.card(await asyncio.to_thread(models.unload, name)))

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request) -> Response | Stream:
        lease, body, jobs = await prepare(request, bodies["/v1/chat/completions"], openai_api.chat_jobs)
        with lease:
            service = lease.service
            handles = await submit(service, jobs)
            if body.stream:
                include = bool(body.stream_options and body.stream_options.include_usage)
                return _stream(lease, jobs, handles, openai_api.chat_stream(service, jobs, handles, include))
            await finish(request, service, jobs, handles)
            return _json(_signed(service, jobs[0], openai_api.chat_body(service, jobs)))

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Response | Stream:
        lease, body, (jobs, echoes) = await prepare(request, bodies["/v1/completions"], openai_api.completion_jobs)
        with lease:
            service = lease.service
            handles = await submit(service, jobs)
            if body.stream:
                include = bool(body.stream_options and body.stream_options.include_usage)
                stream = openai_api.completion_stream(service, jobs, handles, echoes, include)
                return _stream(lease, jobs, handles, stream)
            await finish(request, service, jobs, handles)
            return _json(_signed(service, jobs[0], openai_api.completion_body(service, jobs, echoes)))

    @post("/v1/messages", status_code=200)
    async def messages(request: Request) -> Response | Stream:
        lease, body, job = await prepare(request, MessagesRequest, anthropic_api.messages_job)
        with lease:
            service = lease.service
            handle = await service.submit(job)
            if body.stream:
                stream = anthropic_api.messages_stream(service, job, handle)
                return _stream(lease, job, handle, stream, "anthropic")
            await finish(request, service, job, handle)
            return _json(_signed(service, job, anthropic_api.messages_body(service, job)))

    @post("/v1/messages/count_tokens", status_code=200)
    async def count_tokens(request: Request) -> Response:
        lease, _, count = await prepare(
            request, anthropic_api.CountTokensRequest, lambda s, b, _: anthropic_api.count_tokens(s, b)
        )
        lease.release()
        return _json({"input_tokens": count})

    @post("/v1/responses", status_code=200)
    async def responses(request: Request) -> Response | Stream:
        lease, body, (job, echo) = await prepare(request, ResponsesRequest, responses_api.responses_job)
        with lease:
            service = lease.service
            handle = await service.submit(job)
            if body.stream:
                return _stream(lease, job, handle, responses_api.responses_stream(service, job, handle, echo))
            await finish(request, service, job, handle)
            return _json(_signed(service, job, responses_api.response_body(service, job, echo)))

    @post("/v1/embeddings", status_code=200)
    async def embed(request: Request) -> Response:
        lease, _, answer = await prepare(request, EmbeddingRequest, embeddings.embeddings)
        lease.release()
        return _json(answer)

    @post(list(rerank.PATHS), status_code=200)
    async def rank(request: Request) -> Response:
        lease, _, answer = await prepare(request, RerankRequest, rerank.rerank)
        lease.release()
        return _json(answer)

    @post("/tokenize", status_code=200)
    async def tokenize(request: Request) -> Response:
        lease, _, answer = await prepare(request, TokenizeRequest, tokens)
        lease.release()
        return _json(answer)

    def tokens(service: Service, body: TokenizeRequest, owner: str | None) -> dict[str, Any]:
        if body.messages is not None:
            images = Images()
            _, ids, _ = service.render_chat(openai_api.template_messages(body.messages, images), None, {}, images)
        else:
            text = body.content if body.content is not None else body.prompt
            if text is None:
                raise bad_request("send 'content' (text) or 'messages' to tokenize", "content")
            add = body.add_special if body.add_special is not None else bool(body.add_special_tokens)
            ids = service.tokenizer.encode(text, add_special=add, parse_special=body.parse_special)
        listed: list[Any] = ids
        if body.with_pieces:
            listed = [{"id": i, "piece": service.tokenizer.decode([i], skip_special=False)} for i in ids]
        return {"tokens": listed, "count": len(ids), "max_context": service.max_context}

    @post("/detokenize", status_code=200)
    async def detokenize(request: Request) -> Response:
        lease, _, text = await prepare(request, DetokenizeRequest, detokens)
        lease.release()
        return _json({"content": text, "prompt": text})  # llama.cpp's key, and vLLM's

    @get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        """The tokenizer's special tokens and chat template, as vLLM's endpoint gives them (lm-evaluation-harness's
        remote tokenizer reads them, with /tokenize and /detokenize, instead of loading the model's own)."""
        with await models.acquire(_model_param(request)) as lease:
            service = lease.service
            tokenizer, template = service.tokenizer, service.model.chat_template

            def text(token: int | None) -> str | None:
                return None if token is None else tokenizer.decode([token], skip_special=False)

            return _json(
                {
                    "eos_token": text(tokenizer.eos_id),
                    "bos_token": text(tokenizer.bos_id),
                    "pad_token": None,
                    "add_bos_token": bool(tokenizer.add_bos),
                    "chat_template": template.source,
                    "model_max_length": service.max_context,
                }
            )

    def detokens(service: Service, body: DetokenizeRequest, owner: str | None) -> str:
        vocab = service.model.architecture.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids out of range for the vocabulary of {vocab}: {bad[:5]}", "tokens")
        return service.tokenizer.decode(body.tokens)

    async def on_session(request: Request, call: Callable[..., Any], *args: Any) -> Any:
        """``call(service, owner, *args)`` on a worker thread, for the model of the ``model`` query parameter."""
        with await models.acquire(_model_param(request)) as lease:
            return await workers.run(call, lease.service, _owner(request), *args)

    @get("/v1/sessions")
    async def list_sessions(request: Request) -> Response:
        return _json({"object": "list", "data": await on_session(request, Service.sessions)})

    @delete("/v1/sessions/{name:str}", status_code=200)
    async def delete_session(request: Request, name: FromPath[str]) -> Response:
        await on_session(request, Service.drop_session, name)
        return _json({"id": name, "object": "session", "deleted": True})

    @post("/v1/sessions", status_code=201)
    async def create_session(request: Request) -> Response:
        lease, _, card = await prepare(
            request, SessionRequest, lambda s, body, owner: s.create_session(owner, body.id), _model_param(request)
        )
        lease.release()
        return _json(card, 201)

    @get("/v1/sessions/{name:str}")
    async def get_session(request: Request, name: FromPath[str]) -> Response:
        return _json(await on_session(request, Service.session, name))

    @post("/v1/sessions/{name:str}/fork", status_code=201)
    async def fork_session(request: Request, name: FromPath[str]) -> Response:
        lease, _, card = await prepare(
            request,
            SessionRequest,
            lambda s, body, owner: s.fork_session(owner, name, body.id),
            _model_param(request),
        )
        lease.release()
        return _json(card, 201)

    @post("/v1/sessions/{name:str}/hibernate", status_code=200)
    async def hibernate_session(request: Request, name: FromPath[str]) -> Response:
        return _json(await on_session(request, Service.hibernate_session, name))

    @post("/v1/sessions/{name:str}/restore", status_code=200)
    async def restore_session(request: Request, name: FromPath[str]) -> Response:
        return _json(await on_session(request, Service.restore_session, name))

    # --- llama-server's own endpoints (llamacpp_api) ---------------------------------------------------------------
    async def llama_generation(
        request: Request, kind: type, make: Callable[[Service, Any, str | None], Any]
    ) -> Response | Stream:
        """/completion and /infill: whole (an answer a prompt, an array for several) or streamed."""
        lease, body, jobs = await prepare(request, kind, make)
        with lease:
            service = lease.service
            handles = await submit(service, jobs)
            if body.stream:
                return _stream(lease, jobs, handles, llamacpp_api.completion_stream(service, jobs, handles, body))
            await finish(request, service, jobs, handles)
            answers = [llamacpp_api.completion_body(service, job, i, body) for i, job in enumerate(jobs)]
            return _json(answers if len(answers) > 1 else answers[0])

    @post(["/completion", "/completions"], status_code=200)
    async def llama_completion(request: Request) -> Response | Stream:
        return await llama_generation(request, llamacpp_api.CompletionRequest, llamacpp_api.completion_jobs)

    @post("/infill", status_code=200)
    async def llama_infill(request: Request) -> Response | Stream:
        return await llama_generation(request, llamacpp_api.InfillRequest, llamacpp_api.infill_jobs)

    @post("/apply-template", status_code=200)
    async def llama_apply_template(request: Request) -> Response:
        lease, _, answer = await prepare(request, llamacpp_api.ApplyTemplateRequest, llamacpp_api.apply_template)
        lease.release()
        return _json(answer)

    @get("/props")
    async def llama_props(request: Request) -> Response:
        with await models.acquire(_model_param(request)) as lease:
            stats = await workers.run(lease.service.engine.stats)  # an engine process answers in a round trip
            return _json(llamacpp_api.props(lease.service, int(stats.get("batch_size", 1))))

    # --- Ollama's API (ollama_api) ---------------------------------------------------------------------------------
    async def ollama_generation(request: Request, kind: type, endpoint: str) -> Response | Stream:
        """/api/chat and /api/generate: with nothing to generate (no messages, no prompt) Ollama's way to load a
        model, or with ``keep_alive`` 0 to unload it; else a generation, streamed unless ``stream`` is false."""
        raw = await _read(request)
        name = ollama_api.served_name(models.by_name, models.route(raw))
        body = await workers.run(decode, raw, kind)
        chat = endpoint == "chat"
        if not (body.messages if chat else (body.prompt or body.context or body.images)):
            if ollama_api.unloading(body.keep_alive):
                await asyncio.to_thread(models.unload, name)
                return _json(ollama_api.empty_answer(body.model, endpoint, "unload"))
            await models.load_now(name)
            return _json(ollama_api.empty_answer(body.model, endpoint, "load"))
        make = ollama_api.chat_job if chat else ollama_api.generate_job
        lease, body, job = await prepare(request, kind, make, name, body)
        with lease:
            service = lease.service
            handle = await service.submit(job)
            if body.stream:
                stream = (ollama_api.chat_stream if chat else ollama_api.generate_stream)(
                    body.model, service, job, handle
                )
                return _stream(lease, job, handle, stream, "ollama")
            await finish(request, service, job, handle)
            return _json((ollama_api.chat_body if chat else ollama_api.generate_body)(body.model, job))

    @post("/api/chat", status_code=200)
    async def ollama_chat(request: Request) -> Response | Stream:
        return await ollama_generation(request, ollama_api.ChatRequest, "chat")

    @post("/api/generate", status_code=200)
    async def ollama_generate(request: Request) -> Response | Stream:
        return await ollama_generation(request, ollama_api.GenerateRequest, "generate")

    async def ollama_answer(request: Request, kind: type, make: Callable[[Service, Any, str | None], Any]) -> Response:
        raw = await _read(request)
        lease, _, answer = await prepare(request, kind, make, ollama_api.served_name(models.by_name, models.route(raw)))
        lease.release()
        return _json(answer)

    @post("/api/embed", status_code=200)
    async def ollama_embed(request: Request) -> Response:
        return await ollama_answer(request, ollama_api.EmbedRequest, ollama_api.embed)

    @post("/api/embeddings", status_code=200)
    async def ollama_embeddings(request: Request) -> Response:
        return await ollama_answer(request, ollama_api.EmbeddingsRequest, ollama_api.embeddings)

    @post("/api/show", status_code=200)
    async def ollama_show(request: Request) -> Response:
        raw = await _read(request)
        named = await workers.run(decode, raw, ollama_api.ShowRequest)
        if not (named.model or named.name):
            raise bad_request("send the model to show", "model")
        name = ollama_api.served_name(models.by_name, named.model or named.name or "")
        routed = name if models.routing else ""
        lease, _, answer = await prepare(request, ollama_api.ShowRequest, ollama_api.show, routed, named)
        lease.release()
        return _json(answer)

    @get("/api/tags", sync_to_thread=False)
    def ollama_tags() -> Response:
        return _json({"models": [ollama_api.model_card(entry) for entry in models.entries]})

    @get("/api/ps", sync_to_thread=False)
    def ollama_ps() -> Response:
        running = [e for e in models.entries if e.state == "loaded"]
        return _json({"models": [ollama_api.model_card(entry, running=True) for entry in running]})

    @get("/api/version", sync_to_thread=False)
    def ollama_version() -> Response:
        return _json({"version": __version__})

    @post(["/api/pull", "/api/push", "/api/create", "/api/copy", "/api/blobs/{digest:str}"], status_code=404)
    async def ollama_manage(request: Request) -> Response:
        raise APIError(
            404,
            f"{request.url.path} is not offered here: leat serve's command line names the models it serves "
            "(leat pull fetches one from Hugging Face)",
        )

    @delete("/api/delete", status_code=404)
    async def ollama_delete(request: Request) -> Response:
        raise APIError(404, "/api/delete is not offered here: models are removed with `leat rm`")

    @get("/openapi.json", sync_to_thread=False)
    def openapi(request: Request) -> Response:
        return _json(request.app.openapi_schema.to_schema())

    async def sweep_sessions() -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            try:
                for service in models.loaded():
                    await workers.run(service.sweep_sessions)
            except LeatError as e:  # e.g. the engine process restarting or stopping: the next sweep tries again
                log.warning("dropping stale sessions failed: %s", e)
            except Exception:  # logged; the next sweep tries again
                log.exception("dropping stale sessions failed")

    def start_sweeping(app: Litestar) -> None:
        app.state.sweeper = asyncio.get_running_loop().create_task(sweep_sessions())

    async def warm_up(app: Litestar) -> None:
        """Before the server answers: what a first request would otherwise pay once (the worker threads, a body's
        decoder, and each loaded model's path through its engine: see :meth:`Service.warm_up`). Measured on the
        H200 host: an API process's first request answered its first byte 30 ms later than the next ones."""
        try:
            await workers.run(decode, b'{"model": "", "prompt": [0], "max_tokens": 1}', bodies["/v1/completions"])
            for service in models.loaded():
                await service.warm_up()
        except Exception as e:  # noqa: BLE001 - never keeps the server from serving: its first request pays instead
            log.warning("warming up failed: %s: %s", type(e).__name__, e)

    def stop_sweeping(app: Litestar) -> None:
        app.state.sweeper.cancel()

    def _signed(service: Service, job: Any, body: dict[str, Any]) -> dict[str, Any]:
        receipt = service.receipt(job, body)
        if receipt is not None:
            body["receipt"] = receipt
        return body

    app = Litestar(
        route_handlers=[
            root,
            health,
            metrics_page,
            list_models,
            model,
            load_model,
            unload_model,
            chat,
            completions,
            messages,
            count_tokens,
            responses,
            tokenize,
            detokenize,
            tokenizer_info,
            embed,
            rank,
            list_sessions,
            delete_session,
            create_session,
            get_session,
            fork_session,
            hibernate_session,
            restore_session,
            llama_completion,
            llama_infill,
            llama_apply_template,
            llama_props,
            ollama_chat,
            ollama_generate,
            ollama_embed,
            ollama_embeddings,
            ollama_show,
            ollama_tags,
            ollama_ps,
            ollama_version,
            ollama_manage,
            ollama_delete,
            openapi,
        ],
        exception_handlers={Exception: _error_response},
        openapi_config=OpenAPIConfig(title="leat", version=__version__, path="/schema"),
        request_max_body_size=MAX_BODY,
        on_startup=[start_sweeping, warm_up],
        on_shutdown=[stop_sweeping],
        middleware=[request_log],
    )
    _describe_bodies(app, bodies)
    app.state.models, app.state.service = models, models.default.service
    return Guard(app, keys, host, port, list(allow_origins), metrics)


def _model_param(request: Request) -> str:
    return request.query_params.get("model", "")


def request_bodies(host: PluginHost | None = None) -> dict[str, type]:
    """:data:`BODIES`, chat and completions with the sampling fields the loaded sampler stages declare."""
    fields = sampling_fields(host or plugin_host())
    return BODIES | {path: with_sampling_fields(BODIES[path], fields) for path in SAMPLING_PATHS}


def _describe_bodies(app: Litestar, bodies: dict[str, type]) -> None:
    """Add each POST route's body schema, generated from its msgspec struct, to Litestar's OpenAPI document (the
    handlers decode bodies themselves, so Litestar cannot see them)."""
    openapi = app.openapi_schema
    structs = list(bodies.values())
    _, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    openapi.components.schemas.update(components)
    for path, struct in bodies.items():
        ref = Reference(ref=f"#/components/schemas/{struct.__name__}")
        body = RequestBody(content={JSON: OpenAPIMediaType(schema=ref)}, required=True)
        openapi.paths[path].post.request_body = body
