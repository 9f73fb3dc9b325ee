"""What every endpoint shares: the model and engine, prompts from messages, and one generation's output stream.

An endpoint turns its body into a :class:`Job` (prompt token ids, limits, sampling, how to read the
output), :meth:`Service.submit` hands it to the engine (raising ``Overloaded`` / ``TooLong`` before
anything is sent, so those become 429 / 400), and :meth:`Service.stream` yields :class:`Piece` items
(content, reasoning, tool calls, with their logprobs) as tokens arrive, filling ``job.result`` at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from leat import __version__
from leat.chat import DEFAULT_LIMITS, RESERVED, RenderLimits
from leat.chatformat import Delta, OutputParser, ReasoningSplitter, ToolCall, json_calls
from leat.engine import GenerationRequest, Overloaded, TooLong
from leat.engine_process import EngineUnavailable, Image, logit_bias
from leat.errors import LeatError, TemplateError
from leat.sampling import SamplingParams
from leat.sessions import scoped, unscoped
from leat.textstream import TextStream
from leat.vision import image_tokens, place

from leat_server.errors import APIError, bad_request, unsupported
from leat_server.images import Images
from leat_server.toolcalls import ModelFormat

ENGINE_FIELDS = {f.name for f in dataclasses.fields(GenerationRequest)}

# An API process awaits the engine process's Accepted without blocking its event loop: off by default until it is
# measured on a GPU beside the blocking round trip (the H200 showed a stall with it; docs/serving.md)
ASYNC_SUBMIT = os.environ.get("LEAT_ASYNC_SUBMIT", "") == "1"


@dataclass
class TokenLogprob:
    id: int
    text: str
    logprob: float | None  # None: an echoed prompt's first token (nothing before it)
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class Piece:
    kind: str  # "content" | "reasoning" | "tool_call"
    text: str = ""
    call: ToolCall | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Result:
    finish_reason: str = "stop"
    stop_sequence: str | None = None  # the stop string that ended the output
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused (prefix cache or session)
    reasoning_tokens: int | None = None  # generated up to the end of the <think> closing tag; None: not counted
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded, before parsing (stop strings removed)
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Job:
    endpoint: str
    prompt_ids: list[int]
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    processors: list[Callable] = field(default_factory=list)
    parser: OutputParser | ReasoningSplitter = field(default_factory=OutputParser)
    forced_calls: str | None = None  # the output is one JSON tool call: "any" {name, arguments}, or a tool's arguments
    stop_ids: frozenset[int] = frozenset()  # tokens that end the output (not in it): vLLM's stop_token_ids
    include_stop: bool = False  # the stop string that ended the output stays in it
    skip_special: bool = True
    client: str | None = None  # the client's own tag (``user``): its prefix-cache namespace within the owner's
    session: str | None = None  # as the client names it
    owner: str | None = None  # the API key's owner id (None: the server has no keys); scopes sessions and cache
    images: list[Any] = field(default_factory=list)  # the prompt's image spans (Service.render_chat)
    prompt_logprobs: list[TokenLogprob] | None = None  # an echoed prompt's (completions' echo with logprobs)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    result: Result = field(default_factory=Result)
    started: float = field(default_factory=time.perf_counter)
    submitted: float | None = None  # when it went to the engine, its body read and prepared (perf_counter)
    accepted: float | None = None  # when the engine took it (perf_counter)
    settled: bool = False  # counted in the metrics as finished or cancelled


class Service:
    """The loaded model and its engine, as the endpoints see them."""

    def __init__(
        self,
        model: Any,
        engine: Any,
        name: str,
        metrics: Any = None,
        receipts: Any = None,
        tool_parser: str | None = None,
        reasoning: bool | None = None,
        backend_name: str = "",
        template_limits: RenderLimits = DEFAULT_LIMITS,
    ):
        self.model = model
        self.engine = engine
        self.name = name
        self.metrics = metrics
        self.receipts = receipts
        self.backend_name = backend_name
        self.tokenizer = model.tokenizer
        template = model.chat_template.source
        vocab = model.file.metadata.get("tokenizer.ggml.tokens") or []
        self.format = ModelFormat.of(template, vocab, model.file.architecture, tool_parser, reasoning)
        self.created = int(time.time())
        self.fingerprint = f"leat-{__version__}-{backend_name or 'unknown'}"
        self.template_limits = template_limits

    @property
    def max_context(self) -> int:
        return int(getattr(self.engine, "max_context", self.model.context_length))

    def supports(self, feature: str) -> bool:
        return feature in ENGINE_FIELDS

    # -- prompts ---------------------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        extra: dict[str, Any],
        images: Images,
        generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> tuple[str, list[int], list[Any]]:
        """The prompt's text, token ids and image spans (one per marker ``images`` placed in the messages): the
        assistant's turn opened after them (``generation_prompt``), or with ``continue_final`` the last message, the
        assistant's, left open so that the answer continues it (a prefill: Anthropic's last assistant message,
        vLLM's ``continue_final_message``)."""
        taken = sorted(RESERVED & set(extra))
        if taken:
            raise bad_request(
                f"chat_template_kwargs: {taken[0]!r} is set by the server itself; send it as a request field "
                "(messages, tools) or leave it out",
                "chat_template_kwargs",
            )

        def render(items: list[dict], opened: bool) -> str:
            try:
                return self.model.chat_template.render(
                    items, add_generation_prompt=opened, tools=tools, limits=self.template_limits, **extra
                )
            except TemplateError as e:
                raise bad_request(str(e), param="messages") from None

        if not continue_final:
            text = render(messages, generation_prompt)
        else:
            if not messages or messages[-1].get("role") != "assistant":
                raise bad_request("only the assistant's last message can be continued", "messages")
            content = messages[-1].get("content") or ""
            if not content:  # nothing to continue: the assistant's turn opened after the others
                text = render(messages[:-1], True)
            else:
                closed = render(messages, False)
                kept = next((part for part in (content, content.rstrip()) if part and part in closed), None)
                if kept is None:
                    raise bad_request(
                        "the chat template does not write the assistant's last message as it is, so it cannot be "
                        "continued; send it as a new turn",
                        "messages",
                    )
                text = closed[: closed.rindex(kept) + len(kept)]
        # The template writes BOS itself when the model wants one, so only special tokens are parsed here.
        if not images.data:
            return text, self.tokenizer.encode(text, add_special=False, parse_special=True), []
        return (text, *self.image_prompt(text, images.data))

    def image_prompt(self, text: str, images: list[bytes]) -> tuple[list[int], list[Any]]:
        """Token ids and image spans of a rendered prompt holding a marker per image: spans decoded here when the
        model is in this process, else (an API frontend) the images' bytes for the engine process to decode."""
        vision = getattr(self.model, "vision", None)
        layout = vision.layout() if vision is not None else getattr(self.engine, "info", {}).get("vision")
        if layout is None:
            raise bad_request(
                "image input needs a vision projector: this model is served without one (leat serve --mmproj FILE)",
                "messages",
            )
        try:
            if vision is not None:
                return self.model.image_prompt(text, images, add_special=False)
            counts = [image_tokens(layout, data) for data in images]  # from each image's header: decoded once, there
            ids, starts = place(self.tokenizer, text, len(images), layout["begin"], layout["end"], counts, False)
        except LeatError as e:
            raise bad_request(f"image input: {e}", "messages") from None
        return ids, [Image(start, count, data) for start, count, data in zip(starts, counts, images)]

    def sampling(self, fields: dict[str, Any]) -> SamplingParams:
        seed = fields.get("seed")
        if seed is not None and seed < 0:  # schemas.Seed: -1 a random seed, as llama.cpp's; others wrapped
            fields = {**fields, "seed": None if seed == -1 else seed % 2**64}
        try:
            return SamplingParams.resolve(fields, self.model.file.metadata)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=name if name in fields else None) from None

    def output_parser(self, tools_active: bool, prompt_text: str) -> OutputParser | ReasoningSplitter:
        return self.format.parser(tools_active, prompt_text)

    def skip_special(self, tools_active: bool) -> bool:
        """Control tokens' text is dropped from the output unless a parser needs it (``<|python_tag|>``, channels)."""
        return not (tools_active or self.format.always_parsed)

    def logit_bias(self, bias: dict[str, float] | None) -> list[Callable]:
        if not bias:
            return []
        if not self.supports("processors"):
            raise unsupported("logit_bias", "this engine has no per-request logits processors yet")
        vocab = self.model.architecture.vocab_size
        table = {}
        for key, value in bias.items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
                raise bad_request(f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})", "logit_bias")
            table[int(key)] = value
        return [logit_bias(table)]

    # -- running ---------------------------------------------------------------------------------------------
    async def submit(self, job: Job, count: bool = True) -> Any:
        session = self.session_name(job.owner, job.session) if job.session is not None else None
        room = self.max_context - len(job.prompt_ids)
        max_tokens = job.max_tokens if job.max_tokens is not None else max(room, 1)
        request = {
            "prompt_ids": job.prompt_ids,
            "max_tokens": max_tokens,
            "sampling": job.sampling,
            "client": cache_namespace(job.owner, job.client),
            "session": session,
            "logprobs": job.logprobs,
        }
        if job.ignore_eos and "ignore_eos" in ENGINE_FIELDS:
            request["ignore_eos"] = True
        if job.processors:
            request["processors"] = job.processors
        if job.images:
            request["images"] = job.images
        job.submitted = time.perf_counter()
        try:
            if ASYNC_SUBMIT and (submit_async := getattr(self.engine, "submit_async", None)):
                handle = await submit_async(GenerationRequest(**request))  # an engine process: the loop goes on
            else:  # an engine in this process queues it at once; one in another answers in a round trip
                handle = self.engine.submit(GenerationRequest(**request))
        except EngineUnavailable as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        except LeatError as e:
            if isinstance(e, Overloaded | TooLong):
                raise
            raise bad_request(str(e), param="prompt") from None
        job.accepted = time.perf_counter()
        if self.metrics and count:
            self.metrics.submitted(job.endpoint, len(job.prompt_ids))
        return handle

    # -- sessions --------------------------------------------------------------------------------------------
    @staticmethod
    def session_name(owner: str | None, name: str) -> str:
        """The engine's name for ``owner``'s session ``name`` (checked here: the engine reads it on its thread)."""
        try:
            return scoped(owner, name)
        except LeatError as e:
            raise bad_request(str(e), param="session") from None

    def sessions(self, owner: str | None) -> list[dict[str, Any]]:
        """``owner``'s sessions, by the names it gave them."""
        out = []
        for entry in self.engine.list_sessions():
            name = unscoped(owner, entry["name"])
            if name is not None:
                out.append(
                    {"id": name, "object": "session", "tokens": entry["tokens"], "hibernated": entry["hibernated"]}
                )
        return out

    def session(self, owner: str | None, name: str) -> dict[str, Any]:
        """``owner``'s session ``name``: 404 when it has none of that name (another key's is not its own)."""
        self.session_name(owner, name)
        for card in self.sessions(owner):
            if card["id"] == name:
                return card
        raise APIError(404, f"no session named {name!r}", param="name", code="session_not_found")

    def create_session(self, owner: str | None, name: str) -> dict[str, Any]:
        self.engine.create_session(self._unused_name(owner, name))
        return self.session(owner, name)

    def fork_session(self, owner: str | None, name: str, target: str) -> dict[str, Any]:
        """``target``, a copy of ``name`` sharing its KV until either is extended."""
        self.session(owner, name)
        self.engine.fork_session(self.session_name(owner, name), self._unused_name(owner, target))
        return self.session(owner, target)

    def _unused_name(self, owner: str | None, name: str) -> str:
        """The engine's name for a new session ``name`` of ``owner``: 409 when ``owner`` has one of that name."""
        engine_name = self.session_name(owner, name)
        if any(card["id"] == name for card in self.sessions(owner)):
            raise APIError(409, f"a session named {name!r} exists; delete it first", param="id", code="session_exists")
        return engine_name

    def hibernate_session(self, owner: str | None, name: str) -> dict[str, Any]:
        self.session(owner, name)
        self.engine.hibernate(self.session_name(owner, name))
        return self.session(owner, name)

    def restore_session(self, owner: str | None, name: str) -> dict[str, Any]:
        self.session(owner, name)
        self.engine.restore_session(self.session_name(owner, name))
        return self.session(owner, name)

    def drop_session(self, owner: str | None, name: str) -> None:
        self.session(owner, name)
        self.engine.drop_session(self.session_name(owner, name))

    def sweep_sessions(self) -> None:
        """Drop the sessions past the store's idle time or count (see :class:`leat.sessions.StoreLimits`)."""
        for name in self.engine.stale_sessions():
            try:
                self.engine.drop_session(name)
            except LeatError:
                pass  # in use again since: it stays

    async def stream(self, job: Job, handle: Any) -> AsyncIterator[Piece]:
        """The job's output as it is generated; ``job.result`` is complete once this is exhausted. A request's
        own failure (its constraint, sampler) raises a 400, the engine's a 500."""
        job.result.prompt_tokens = len(job.prompt_ids)
        text = TextStream(self.tokenizer, job.stop, skip_special=job.skip_special)
        pending: list[TokenLogprob] = []
        finished = False
        try:
            async for event in handle.aiter():
                if event.kind == "tokens":
                    if not text.stopped:
                        for piece in self._take(job, event, text, pending):
                            yield piece
                        if text.stopped:
                            handle.cancel()  # the engine's "done" follows at its next step
                    continue
                finished = True
                if event.kind == "error":
                    raise _failure(event)
                for piece in self._end(job, event, text, pending):
                    yield piece
                break
        finally:
            if not finished:
                self.abandon(job, handle)
            elif not job.settled:
                job.settled = True
                if self.metrics:
                    self.metrics.finished(job.endpoint, job.result, time.perf_counter() - job.started)

    async def stream_all(self, jobs: list[Job], handles: list[Any]) -> AsyncIterator[tuple[int, Piece]]:
        """:meth:`stream` of several jobs at once (a request's choices): ``(index, piece)`` as each job's pieces
        come; the first failure ends it, and every job still running ends with it."""
        if len(jobs) == 1:
            async for piece in self.stream(jobs[0], handles[0]):
                yield 0, piece
            return
        queue: asyncio.Queue[tuple[int, Piece | None, BaseException | None]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for piece in self.stream(jobs[index], handles[index]):
                    await queue.put((index, piece, None))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put((index, None, e))
                return
            await queue.put((index, None, None))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(jobs))]
        try:
            running = len(pumps)
            while running:
                index, piece, error = await queue.get()
                if error is not None:
                    raise error
                if piece is None:
                    running -= 1
                    continue
                yield index, piece
        finally:  # a job still running (a failure, or the client gone) is cancelled by its stream's own clean-up
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def warm_up(self) -> None:
        """Generate one token for a one-token prompt the way a request does (the engine and its sampler, the
        text stream), so that imports, threads and tables made on first use are made before the first request.
        Not counted in the metrics."""
        job = Job("warmup", [0], 1, self.sampling({"temperature": 0}), ignore_eos=True)
        job.settled = True  # nothing to count
        async for _ in self.stream(job, await self.submit(job, count=False)):
            pass

    def abandon(self, job: Job, handle: Any) -> None:
        """Cancel ``job``'s engine request (its client is gone, or its answer was cut short): the engine frees its
        slot and KV pages at its next step, and it is counted as cancelled. Does nothing for a request that has
        ended or been abandoned before (no message to an engine process, no second count)."""
        if job.settled:
            return
        job.settled = True
        handle.cancel()
        if self.metrics:
            self.metrics.cancelled(job.endpoint)

    async def run(self, job: Job, handle: Any) -> Result:
        async for _ in self.stream(job, handle):
            pass
        return job.result

    def _take(self, job: Job, event: Any, text: TextStream, pending: list[TokenLogprob]) -> list[Piece]:
        """The pieces one step's tokens make, up to the one that completes a stop string."""
        result = job.result
        if not result.token_ids and self.metrics and not job.settled:
            self.metrics.first_token(job.endpoint, time.perf_counter() - job.started)
        read, ids, stopped = text.ids_read, event.ids, text.stopped
        ended = next((i for i, token in enumerate(ids) if token in job.stop_ids), None) if job.stop_ids else None
        chunk = text.feed(ids if ended is None else ids[:ended])
        if ended is not None and not text.stopped:  # a stop token: what is held back is text, and the output ends
            chunk += text.flush()
            text.stopped = True
        if job.include_stop and text.matched and not stopped:  # the stop string that ended it, once
            chunk += text.matched
        used = text.ids_read - read
        result.token_ids.extend(event.ids[:used])
        if job.logprobs is not None and event.logprobs is not None:
            scored = self._logprobs(event, used)
            pending.extend(scored)
            result.logprobs.extend(scored)
        return self._parse(job, chunk, pending)

    def _end(self, job: Job, done: Any, text: TextStream, pending: list[TokenLogprob]) -> list[Piece]:
        """The last pieces (held-back text, parsers' leftovers, forced tool calls) and the result's totals."""
        result = job.result
        usage = done.usage or {}
        # once the text stopped, the engine's count may include tokens generated before it saw the cancel
        result.completion_tokens = (
            len(result.token_ids) if text.stopped else int(usage.get("completion_tokens", len(result.token_ids)))
        )
        result.cached_tokens = int(usage.get("cached_tokens", 0))
        result.timings = dict(done.timings or {})
        pieces = self._parse(job, text.flush(), pending) + self._finish(job, pending)
        result.reasoning_tokens = self._reasoning_tokens(job)
        result.finish_reason = "stop" if text.stopped else done.finish_reason or "stop"
        result.stop_sequence = text.matched
        if result.tool_calls and result.finish_reason == "stop":
            result.finish_reason = "tool_calls"
        return pieces

    def _reasoning_tokens(self, job: Job) -> int | None:
        """How many generated tokens the ``<think>`` section took, its closing tag included: the fewest leading
        tokens whose text holds the tag (all of them when it never closed). None for a format with its own
        reasoning channel, which is not counted."""
        parser, ids = job.parser, job.result.token_ids
        if not isinstance(parser, ReasoningSplitter):
            return None if parser.own_reasoning else 0
        if not parser.started:
            return 0
        if not parser.done:
            return len(ids)
        low, high = 1, len(ids)
        while low < high:  # the text of a prefix only grows, so the first prefix holding the tag is found by halving
            middle = (low + high) // 2
            if ReasoningSplitter.CLOSE in self.tokenizer.decode(ids[:middle], skip_special=False):
                high = middle
            else:
                low = middle + 1
        return low

    def _logprobs(self, event: Any, count: int) -> list[TokenLogprob]:
        """The first ``count`` tokens' logprobs of a "tokens" event, with their text."""
        tops = event.top_logprobs or [[] for _ in event.ids]
        return [
            TokenLogprob(token, self.piece(token), logprob, [(t, self.piece(t), lp) for t, lp in top])
            for token, logprob, top in zip(event.ids[:count], event.logprobs, tops)
        ]

    def piece(self, token: int) -> str:
        """One token's text (special tokens' too), as logprobs name it."""
        return self.tokenizer.decode([token], skip_special=False)

    def _parse(self, job: Job, text: str, pending: list[TokenLogprob]) -> list[Piece]:
        job.result.text += text
        if job.forced_calls is not None:
            return []  # the whole output is read as tool calls at the end
        pieces = [self._record(job, d) for d in job.parser.feed(text)] if text else []
        return self._attach(pieces, pending)

    def _finish(self, job: Job, pending: list[TokenLogprob]) -> list[Piece]:
        if job.forced_calls is None:
            pieces = [self._record(job, d) for d in job.parser.finish()]
        else:
            calls = self._forced(job)
            if calls is None:  # cut off by max_tokens: what there is goes back as content
                pieces = [self._record(job, Delta("content", job.result.text))]
            else:
                pieces = [self._record(job, Delta("tool_call", call=c)) for c in calls]
        pieces = self._attach(pieces, pending)
        if pending:
            pieces.append(Piece("content", logprobs=list(pending)))
            pending.clear()
        return pieces

    def _forced(self, job: Job) -> list[ToolCall] | None:
        text = job.result.text
        if job.forced_calls == "any":
            return json_calls(text)
        try:
            args = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [ToolCall(job.forced_calls, json.dumps(args, ensure_ascii=False))] if isinstance(args, dict) else None

    def _record(self, job: Job, delta: Delta) -> Piece:
        result = job.result
        if delta.kind == "content":
            result.content += delta.text
        elif delta.kind == "reasoning":
            result.reasoning += delta.text
        else:
            result.tool_calls.append(delta.call)
        return Piece(delta.kind, delta.text, delta.call)

    @staticmethod
    def _attach(pieces: list[Piece], pending: list[TokenLogprob]) -> list[Piece]:
        if pending and pieces:
            pieces[0].logprobs = list(pending)
            pending.clear()
        return pieces

    # -- receipts ----------------------------------------------------------------------------------------------
    def receipt(self, job: Job, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        if self.receipts is None:
            return None
        result = job.result
        claims = {
            "response_id": job.id,
            "endpoint": job.endpoint,
            "model": self.name,
            "model_sha256": self.receipts.model_sha256(),
            "backend": self.backend_name,
            "sampling": job.sampling.as_dict(),
            "max_tokens": job.max_tokens,
            "stop": list(job.stop),
            "prompt_tokens": len(job.prompt_ids),
            "prompt_sha256": token_hash(job.prompt_ids),
            "output_tokens": len(result.token_ids),
            "output_sha256": token_hash(result.token_ids),
            "output_text_sha256": hashlib.sha256(result.text.encode()).hexdigest(),
            "finish_reason": result.finish_reason,
            "timings": {k: round(float(v), 6) for k, v in result.timings.items() if isinstance(v, int | float)},
            "created": job.created,
        }
        if job.owner is not None:
            claims["owner"] = job.owner
        if body is not None:
            claims["body_sha256"] = self.receipts.body_hash(body)
        return self.receipts.sign(claims)


def _failure(event: Any) -> APIError:
    """The HTTP error for an engine "error" event: 400 when the request's own parts failed, 503 when the engine
    process went away (retry), else 500."""
    if event.fault == "request":
        return APIError(400, f"generation failed: {event.error}", type="invalid_request_error")
    if event.fault == "unavailable":
        return APIError(503, f"generation failed: {event.error}", type="server_error", code="engine_unavailable")
    return APIError(500, f"generation failed: {event.error}", type="server_error")


def cache_namespace(owner: str | None, client: str | None) -> str | None:
    """The engine's prefix-cache namespace: the API key's owner id first, so no tag a client sends reaches another
    key's entries; within it, the client's own tag."""
    if owner is None:
        return client
    return f"{owner}/{client}" if client else owner


def token_hash(ids: list[int]) -> str:
    """SHA-256 of token ids as little-endian uint32, the form ``leat receipts verify`` recomputes."""
    return hashlib.sha256(b"".join(int(i).to_bytes(4, "little") for i in ids)).hexdigest()
