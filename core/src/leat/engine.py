"""The engine: a scheduler thread that owns the device and serves many requests at once.

Each step batches the decode rows of the running requests (one token each) with one prefill chunk
of an admitted prompt, so long prompts never stall the others' decoding. KV lives in fixed-size
pages, one pool per sliding-window group (:class:`leat.pages.PageBudget`); a request is admitted only when
its page-rounded worst case (prompt + max_tokens) fits, so nothing runs out of memory mid-request. Named
sessions keep their pages between requests (:class:`leat.sessions.SessionKV`). The asyncio side talks to
the scheduler through :class:`RequestHandle` queues.

The engine has no text: a request is token ids in, and out comes one :class:`Event` per step with the ids it
gained (detokenizing and stop strings are :class:`leat.textstream.TextStream`'s, in the frontend). A request
whose own parts fail (a logits processor, its sampler, its draft, its logprobs) ends alone with an "error"
event marked ``fault="request"``; a failed forward pass ends every request in it, ``fault="engine"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from leat.backend import window_groups
from leat.batch import Batch, Row
from leat.compare import log_softmax
from leat.errors import LeatError
from leat.kvpool import PagePool
from leat.options import EngineOptions
from leat.pages import BackendPages, PageBudget, RowPages, size_kv
from leat.sampling import Sampler, SamplingParams, generator
from leat.sessions import Session, SessionKV, SessionStore, check_name, model_fingerprint
from leat.speculative import Controller, Speculation, accept_greedy, verify
from leat.vision import ImageSpan, keyed, next_chunk

if TYPE_CHECKING:  # asyncio is imported by aiter() alone: a process that reads no request in an event loop
    import asyncio  # (leat generate, leat run) does without it

KV_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}
MAX_CANDIDATES = 64  # the most top-k candidates per row a step fetches instead of whole logit rows


class Overloaded(LeatError):
    """No capacity now: retry after ``retry_after`` seconds (HTTP 429/503 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class TooLong(LeatError):
    """The request can never fit: its prompt plus max_tokens exceed ``limit`` tokens."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


@dataclass
class GenerationRequest:
    """Token ids in, token ids out: stop strings and text are the caller's (:class:`leat.textstream.TextStream`),
    which cancels the request once its text stops."""

    prompt_ids: Sequence[int]
    max_tokens: int = 128
    sampling: SamplingParams | dict[str, Any] | None = None
    session: str | None = None
    client: str | None = None
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also the top k
    ignore_eos: bool = False
    # logits processors (constrained decoding, logit bias): (float64 logits row, generated ids) -> logits. One that
    # raises ends only its request; a ``label`` attribute names it in the error ("response_format constraint").
    processors: Sequence[Callable[[np.ndarray, Sequence[int]], np.ndarray]] = ()
    # the prompt's images (leat.vision.Vision.prompt), in order: their spans' inputs are the images' embeddings
    images: Sequence[ImageSpan] = ()


class Event(msgspec.Struct, omit_defaults=True):
    """What one request gained in one step, or how it ended; a request's events end with one "done" or "error".

    * ``"tokens"``: ``ids``, the tokens the step generated, in order (a verified draft gains several; the
      end-of-generation token is not sent). With ``logprobs`` asked for, ``logprobs[i]`` is the log-probability
      of ``ids[i]`` and ``top_logprobs[i]`` the top k (id, log-probability) pairs at its position.
    * ``"done"``: ``finish_reason`` ("stop": end of generation; "length": max_tokens; "cancelled"), ``usage``
      (prompt_tokens, completion_tokens, cached_tokens) and ``timings`` (ttft_seconds, total_seconds).
    * ``"error"``: ``error``, what failed, and ``fault``: "request" when the request's own parts failed (its
      processors, sampler, draft or logprobs: a client error), "engine" when the step failed for every request.
    """

    kind: str
    ids: list[int] = []
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    timings: dict[str, float] | None = None
    error: str | None = None
    fault: str | None = None


class RequestFault(LeatError):
    """A part that belongs to one request (its processors, sampler, draft, logprobs) failed: it ends that request
    only, with the message as its error."""

    def __init__(self, what: str, cause: Exception):
        super().__init__(f"{what} failed: {type(cause).__name__}: {cause}")


class RequestHandle:
    """A submitted request's :class:`Event` stream, read by iterating it (a thread) or with ``aiter()`` (asyncio);
    ``cancel()`` ends the request at the scheduler's next step."""

    def __init__(self, request_id: int):
        self.id = request_id
        self.cancelled = threading.Event()
        self._events: queue.Queue[Event] = queue.Queue()
        self._lock = threading.Lock()
        # set by aiter(): the event loop that reads this request, and the queue it reads from
        self._reader: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event]] | None = None
        self._sink: Callable[[list[tuple[RequestHandle, Event]]], None] | None = None
        self.remote_id = -1

    def emit(self, event: Event) -> None:
        deliver([(self, event)])

    def attach(self, sink: Callable[[list[tuple[RequestHandle, Event]]], None], remote_id: int) -> None:
        """Send this request's events to ``sink`` from now on (those already queued first), in the batches
        :func:`deliver` makes: the engine process forwards a step's events to a frontend in one message."""
        with self._lock:
            self._sink, self.remote_id = sink, remote_id
            queued = []
            while not self._events.empty():
                queued.append((self, self._events.get_nowait()))
        if queued:
            sink(queued)

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self._events.get()
            yield event
            if event.kind in ("done", "error"):
                return

    async def aiter(self) -> AsyncIterator[Event]:
        import asyncio

        events: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            self._reader = (asyncio.get_running_loop(), events)
            while not self._events.empty():
                events.put_nowait(self._events.get_nowait())
        while True:
            event = await events.get()
            yield event
            if event.kind in ("done", "error"):
                return


def deliver(events: Sequence[tuple[RequestHandle, Event]]) -> None:
    """Hand events to their handles: those read from a thread at once, those read in an event loop with one
    wake-up of each loop for all of them (a step's events cost a loop one callback, not one per request), those
    with a sink (:meth:`RequestHandle.attach`) in one call of each sink."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
    by_sink: dict[Callable[[list[tuple[RequestHandle, Event]]], None], list[tuple[RequestHandle, Event]]] = {}
    for handle, event in events:
        with handle._lock:
            if handle._sink is not None:
                by_sink.setdefault(handle._sink, []).append((handle, event))
            elif handle._reader is None:
                handle._events.put(event)
            else:
                loop, events_of_loop = handle._reader
                by_loop.setdefault(loop, []).append((events_of_loop, event))
    for sink, batch in by_sink.items():
        sink(batch)
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:
            pass  # the loop closed: nobody reads these any more


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for events, event in items:
        events.put_nowait(event)


@dataclass
class StepProfile:
    """Where one engine step's time went (``Engine(profile=True)``): building the batch and launching the forward
    (``prepare``), waiting for what comes back to the host (``wait``), taking the results and sending events
    (``finish``), and the forward's time on the device where the backend can tell (``device``); seconds. ``at`` is
    when the step began (``time.perf_counter()``), ``prompt_tokens`` how many of its tokens were prompt chunks."""

    rows: int
    tokens: int
    prepare: float
    wait: float
    finish: float
    device: float | None
    at: float = 0.0
    prompt_tokens: int = 0


@dataclass
class _Running:
    request: GenerationRequest
    handle: RequestHandle
    sampler: Sampler
    tokens: list[int]
    prompt_len: int
    submitted: float
    slot: int = -1
    filled: int = 0  # positions already in the KV cache
    held: RowPages = field(default_factory=RowPages)  # its pages, from admission to its end
    first_token_at: float | None = None
    cached: int = 0  # prompt tokens whose KV was reused, not computed
    speculation: Controller | None = None  # None: this request never drafts
    draft: list[int] = field(default_factory=list)  # tokens proposed for the row in flight
    # what this step generated, sent as one event at its end
    gained: list[int] = field(default_factory=list)
    gained_logprobs: list[float] = field(default_factory=list)
    gained_top: list[list[tuple[int, float]]] = field(default_factory=list)
    ended: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class _Readout:
    """What of a step's output came to the host: the argmax ids, top-k candidates (values, ids) of ``vocab``, or
    whole logit rows."""

    chosen: np.ndarray | None = None
    candidates: tuple[np.ndarray, np.ndarray] | None = None
    vocab: int = 0
    logits: np.ndarray | None = None

    def argmax(self) -> np.ndarray:
        """Each output row's argmax, from the ids or the candidates (whose first column it is)."""
        if self.chosen is not None:
            return self.chosen
        if self.candidates is None:
            raise ValueError("whole logit rows came to the host, not their argmax")
        return self.candidates[1][:, 0]


class Engine:
    def __init__(
        self, model: Any, options: EngineOptions | None = None, speculation: Speculation | None = None, **fields: Any
    ):
        """An engine for ``model`` with ``options`` (their fields may also be given one by one over them,
        ``Engine(model, batch_size=4)``); ``speculation``: the drafting its requests may use."""
        options = dataclasses.replace(options or EngineOptions(), **fields)
        if options.kv not in KV_BYTES:
            raise LeatError(f"--kv must be one of {', '.join(KV_BYTES)}, not {options.kv!r}")
        self.options = options
        self.model = model
        self.backend = model.backend
        self.batch_size = options.batch_size
        self.prefill_chunk = options.prefill_chunk
        # prompt tokens of one step, over several prompts (a burst of prompts starts in few, large steps)
        self.prefill_budget = max(options.prefill_chunk, options.prefill_budget or self.backend.prefill_tokens_per_step)
        self.page_size = options.page_size
        self.max_queue = options.max_queue
        self.kv_dtype = options.kv
        self.speculation = speculation
        # a recurrent state rewinds only into a verified draft (Backend.gated_delta_net): no cached prefix or session
        self.recurrent = model.architecture.recurrent
        if self.recurrent and speculation is not None and not self.backend.rewinds_drafts:
            raise LeatError(
                f"this model keeps a recurrent state, which the {self.backend.name} backend does not rewind past a "
                f"rejected draft yet: speculate on --backend cpu, or without --speculate"
            )
        self.top_k_candidates = options.top_k_candidates
        self._allocate(options)
        fingerprint = model_fingerprint(model, options.kv, self.page_size, self.windows)
        self.sessions = SessionStore(options.session_store, fingerprint)
        self.session_kv = SessionKV(self.sessions, self.budget, self.budget.device)
        self.free_slots = list(range(self.batch_size - 1, -1, -1))
        self.waiting: deque[_Running] = deque()
        self.running: list[_Running] = []
        self._ids = itertools.count(1)
        self._wake = threading.Condition()
        self._state = threading.RLock()  # pages, slots, running and sessions: the scheduler's, or a session call's
        self._stop = False
        self._thread: threading.Thread | None = None
        # steps, those carrying a prompt chunk (never queued ahead), seconds in steps (the rest waited for work)
        self.steps, self.prefill_steps, self.busy = 0, 0, 0.0
        # events of the step just taken: on a backend whose forward returns before the device finishes, they are
        # sent while the next step runs on the device, not between the two
        self._outbox: list[tuple[RequestHandle, Event]] = []
        self._overlap = bool(getattr(self.backend, "asynchronous", False))
        # a decode step queued before the last one's tokens reached the host (its tokens fed on the device)
        self._pipeline = options.pipeline and bool(getattr(self.backend, "feeds_tokens", False))
        self._ahead: tuple[list[tuple[_Running, Row]], Any, Any] | None = None  # rows, output, device timer
        self._embedding = 0  # embed and rank calls waiting for the step queued ahead: none is queued meanwhile
        self._callers = 0  # other threads waiting for the state (a session call): the scheduler lets them in first
        self.steps_ahead = 0
        self.profile: list[StepProfile] | None = [] if options.profile else None
        self._finished_speculation = {"proposed": 0, "accepted": 0, "verifications": 0}

    def _allocate(self, options: EngineOptions) -> None:
        """Size the KV cache to the budget and allocate it, one page group per sliding window (one for all layers
        without ``window_pages``)."""
        layouts = self.model.architecture.kv_layouts(self.model.architecture.params)
        if options.window_pages:
            groups, self.windows = window_groups(layouts)
        else:
            groups, self.windows = [0] * len(layouts), [None]
        group_bytes = [
            sum(layout.bytes_per_token(1) for layout, g in zip(layouts, groups) if g == group) * KV_BYTES[options.kv]
            for group in range(len(self.windows))
        ]
        # the most positions one step writes for a row: a prefill chunk, or a decode token and its draft
        draft = self.speculation.max_draft if self.speculation is not None else 0
        self.span = max(options.prefill_chunk, 1 + draft)
        budget = self.backend.kv_budget_bytes() if options.kv_budget_bytes is None else options.kv_budget_bytes
        self.max_context, pages, self.plan = size_kv(
            group_bytes,
            self.windows,
            slots=self.batch_size,
            page_size=self.page_size,
            span=self.span,
            model_context=self.model.context_length,
            max_context=options.max_context,
            budget=budget,
        )
        self.kv = self.backend.allocate_kv(
            layouts, self.batch_size, self.max_context, pages, self.page_size, dtype=options.kv, groups=groups
        )
        self.budget = PageBudget(pages, self.windows, self.page_size, self.span, BackendPages(self.backend, self.kv))

    @property
    def pools(self) -> list[PagePool]:
        """Each page group's pool (:attr:`budget`'s)."""
        return self.budget.pools

    @property
    def pool(self) -> PagePool:
        """The page pool of the first group: full attention, and the only group without windowed layers."""
        return self.budget.pools[0]

    @pool.setter
    def pool(self, pool: PagePool) -> None:
        self.budget.pools[0] = pool

    # -- the asyncio / caller side -------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the scheduler thread, then run the backend's warm-up steps (:meth:`warm_up`)."""
        self._thread = threading.Thread(target=self._loop, name="leat-scheduler", daemon=True)
        self._thread.start()
        self.warm_up()
        return self

    def warm_up(self) -> None:
        """Run a step of each size in ``Backend.warm_up_steps`` (at most the prefill budget): prompts of random
        tokens (no prefix shared with one another or any client's: their client is the warm-up's own), one token
        generated each. Their pages are freed and the step counters count from after them; the step log shows
        their steps."""
        longest = min(self.prefill_chunk, self.max_context - 1)  # a prompt's tokens, one generated after them
        if not self.backend.warm_up_steps or longest < 1:
            return
        rng, vocab = generator(0), self.model.architecture.vocab_size
        for tokens in self.backend.warm_up_steps:
            tokens = min(tokens, self.prefill_budget, longest * self.batch_size)
            lengths = [longest] * (tokens // longest) + [tokens % longest] * bool(tokens % longest)
            prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
            for handle in [
                self.submit(GenerationRequest(p, 1, {"temperature": 0}, client="leat-warm-up")) for p in prompts
            ]:
                for _ in handle:
                    pass
        with self._state:
            self.steps, self.prefill_steps, self.steps_ahead, self.busy = 0, 0, 0, 0.0
            for pool in self.pools:
                pool.forget_cached()  # the warm-up's prompts: no one's prefix

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread:
            self._thread.join(timeout=10)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        prompt = list(request.prompt_ids)
        if not prompt:
            raise LeatError("the prompt is empty")
        vocab = self.model.architecture.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise LeatError(f"prompt token id out of range for the vocabulary of {vocab}")
        need = len(prompt) + request.max_tokens
        if need > self.max_context:
            raise TooLong(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({request.max_tokens}) exceeds the context "
                f"of {self.max_context} tokens",
                limit=self.max_context,
            )
        if request.session is not None:
            check_name(request.session)
            if self.recurrent:
                raise LeatError("this model keeps a recurrent state per sequence, which sessions do not keep yet")
        if request.images and getattr(self.model, "vision", None) is None:
            raise LeatError("this model has no vision projector for the prompt's images: load one with --mmproj")
        params = request.sampling
        if not isinstance(params, SamplingParams):
            params = SamplingParams.resolve(params or {}, self.model.file.metadata)
        handle = RequestHandle(next(self._ids))
        item = _Running(request, handle, Sampler.build(params), prompt, len(prompt), time.perf_counter())
        if self.speculation is not None:
            item.speculation = self.speculation.controller(item.sampler)
        with self._wake:
            beyond = len(self.waiting) - len(self.free_slots)  # those a free slot takes at the next step don't wait
            if beyond >= self.max_queue:
                raise Overloaded(
                    f"every batch slot is taken and {beyond} requests wait (the queue holds {self.max_queue}); "
                    "retry shortly",
                    retry_after=1.0,
                )
            self.waiting.append(item)
            self._wake.notify()
        return handle

    def stats(self) -> dict[str, Any]:
        a = self.backend.allocations
        return {
            "queue_depth": len(self.waiting),
            "running": len(self.running),
            **self.budget.stats(),
            "kv": self.kv_dtype,
            "max_context": self.max_context,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "prefill_steps": self.prefill_steps,
            "steps_ahead": self.steps_ahead,
            "busy_seconds": self.busy,
            **({"speculation": self._speculation_stats()} if self.speculation is not None else {}),
            "allocations": {"weights": a.weights, "kv": a.kv, "scratch": a.scratch},
        }

    # -- the scheduler thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and (self._callers or (not self.waiting and not self.running)):
                    self._wake.wait()
                if self._stop:
                    break
            with self._state:
                with self._wake:
                    self._reap_cancelled()
                    self._admit()
                if self.running:
                    try:
                        self.step()
                    except Exception as e:  # noqa: BLE001 (a failed step ends its requests, never the server)
                        self._ahead = None
                        for item in list(self.running):
                            self._finish(item, "error", f"engine step failed: {type(e).__name__}: {e}", fault="engine")
                if not self.running:
                    self._flush()
        for item in list(self.running) + list(self.waiting):
            self._post(item.handle, Event("done", finish_reason="cancelled", usage=self._usage(item)))
        self._flush()

    def _reap_cancelled(self) -> None:
        for item in [w for w in self.waiting if w.handle.cancelled.is_set()]:
            self.waiting.remove(item)
            self._post(item.handle, Event("done", finish_reason="cancelled", usage=self._usage(item)))
        for item in [r for r in self.running if r.handle.cancelled.is_set()]:
            self._finish(item, "cancelled")

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            item = self.waiting[0]
            session = self.sessions.get(item.request.session) if item.request.session else None
            if session is not None and session.busy:
                return  # one request at a time extends a session
            if not self._reserve(item, session):
                return  # wait for pages to come back
            self.waiting.popleft()
            prompt = keyed(item.tokens[: item.prompt_len], item.request.images)
            item.held.prefix_keys = self._prefix_keys(item.request.client, prompt)
            item.slot = self.free_slots.pop()
            if session is not None:
                session.busy = True
            self.running.append(item)

    def _reserve(self, item: _Running, session: Session | None) -> bool:
        """Share what can be reused (a session's pages or cached prefix pages), reserve the rest."""
        if session is not None and session.hibernated and not self.session_kv.restore(session):
            return False
        prompt = keyed(item.tokens[: item.prompt_len - 1], item.request.images)  # an image's positions by its digest
        found = self.session_kv.reuse(session, prompt) if session is not None else None
        lender = session if found is not None else None  # the session whose pages this row borrows
        lent = lender.pages if lender is not None else None
        keys = self._prefix_keys(item.request.client, prompt)
        reuse, shared = found or self.budget.lookup(keys)
        # a session's partly filled last page is copied before writing (a cached prefix is whole pages)
        copy = reuse % self.page_size != 0
        held = self.budget.reserve(item.prompt_len + item.request.max_tokens, shared, copy, lent, keep=session)
        if held is None:
            return False
        if lender is not None:
            self.session_kv.lend_window(lender)
        item.held, item.filled, item.cached = held, reuse, reuse
        return True

    def _prefix_keys(self, client: str | None, prompt: list[Any]) -> list[bytes]:
        return [] if self.recurrent else self.budget.prefix_keys(client, prompt)

    # -- sessions (callable from any thread) ---------------------------------------------------------
    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The scheduler's state, for a call from another thread, between two of its steps (the scheduler waits for
        callers before its next step). A lock alone starved such a call behind a busy scheduler, which holds it
        through each step and takes it back at once: a session call waited out whole bursts (an API process's
        session sweep held up its requests' submits ~1.7 s on the H200)."""
        with self._wake:
            self._callers += 1
        try:
            self._state.acquire()
        finally:
            with self._wake:
                self._callers -= 1
                self._wake.notify_all()
        try:
            yield
        finally:
            self._state.release()

    def fork_session(self, source: str, target: str) -> None:
        """``target`` starts as a copy of ``source``, sharing its pages until either writes."""
        with self._held():
            if not self.session_kv.fork(source, target):
                raise Overloaded("no KV pages free to restore the session being forked", retry_after=1.0)

    def hibernate(self, name: str) -> None:
        with self._held():
            self.session_kv.hibernate(name)

    def create_session(self, name: str) -> None:
        """An empty session ``name`` (kept in memory until a request extends it); one that exists is left as it is."""
        with self._held():
            self.sessions.get(name).last_used = time.monotonic()

    def restore_session(self, name: str) -> None:
        """Read a hibernated session's KV back into pages now, so its next request need not wait for the read."""
        with self._held():
            if not self.session_kv.wake(name):
                raise Overloaded("no KV pages free to restore the session", retry_after=1.0)

    def drop_session(self, name: str) -> None:
        with self._held():
            self.session_kv.drop(name)

    def stale_sessions(self) -> list[str]:
        """Idle sessions past the store's time or count limits, oldest first (the server drops them)."""
        with self._held():
            return self.sessions.stale()

    def list_sessions(self) -> list[dict[str, Any]]:
        with self._held():
            return self.session_kv.listing()

    # -- embeddings and reranking (callable from any thread) -----------------------------------------
    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each prompt's embedding (:meth:`leat.model.Model.embed`), run between the scheduler's steps."""
        return self._between_steps(prompts, lambda ids: self.model.embed(ids).tolist())

    def rank(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each reranker prompt's label probabilities (:meth:`leat.model.Model.rank`), between the scheduler's steps."""
        return self._between_steps(prompts, lambda ids: self.model.rank(ids).tolist())

    def score(self, prompts: list[list[int]], top: int) -> list[list[tuple[float, list[tuple[int, float]]]]]:
        """Each prompt's tokens after its first: the log-probability of each after those before it, and the ``top``
        likeliest tokens there (id, log-probability), as a request's logprobs are (an OpenAI completion's ``echo``
        with ``logprobs``, which evaluation harnesses read). Each prefill chunk runs between the scheduler's steps;
        its log-probabilities are worked out while the steps go on."""
        return [self._prompt_logprobs(ids, top) for ids in prompts]

    def _prompt_logprobs(self, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
        from leat.model import PREFILL_CHUNK

        model, out = self.model, list[tuple[float, list[tuple[int, float]]]]()
        model._check_tokens(np.asarray(ids, dtype=np.int64))
        kv = self._between_steps([ids], lambda _: model.new_kv(len(ids), dtype=self.kv_dtype))[0]  # the engine's type

        def forward(_: list[int], row: Row) -> np.ndarray:
            return model.backend.to_host(model.architecture.forward(Batch([row]), kv))

        for at in range(0, len(ids), PREFILL_CHUNK):
            row = Row(0, at, np.asarray(ids[at : at + PREFILL_CHUNK], np.int64), all_logits=True)
            logits = self._between_steps([ids], functools.partial(forward, row=row))[0]
            for logp, token in zip(map(log_softmax, logits), ids[at + 1 : at + 1 + len(row.tokens)]):
                out.append((float(logp[token]), [(int(t), float(logp[t])) for t in _top(logp, top)] if top else []))
        return out

    def _between_steps(self, prompts: list[list[int]], run: Callable[[list[int]], Any]) -> list[Any]:
        """``run`` on each prompt (a KV of its own), between the scheduler's steps: none is queued ahead meanwhile,
        so no device step is in flight while these run."""
        for ids in prompts:
            if len(ids) > self.max_context:
                raise TooLong(f"an input of {len(ids)} tokens is over the context", limit=self.max_context)
        with self._wake:
            self._embedding += 1
        try:
            while True:
                with self._held():
                    if self._ahead is None:
                        return [run(ids) for ids in prompts]
                time.sleep(0.001)  # the scheduler's next step takes the step queued ahead
        finally:
            with self._wake:
                self._embedding -= 1

    def step(self) -> None:
        """One forward pass: every decoding request's next token plus prefill chunks of up to ``prefill_budget``
        prompt tokens in all (each prompt's chunk at most ``prefill_chunk``). The first prompt in line takes its
        next chunk; the prompts after it join while their next chunk fits what is left, so short prompts arriving
        together start together (fewer, larger steps), and a prompt's chunks are the same as when it is alone. Each
        request with new tokens gets one event; one whose own parts fail (:class:`RequestFault`) ends alone, the
        others go on."""
        began = time.perf_counter()  # the step-cost table times whole steps: proposing and verifying cost too
        rows, out, timer = self._launch()
        if not rows:
            self._flush()
            return
        launched = time.perf_counter()
        if self._overlap:
            self._flush()  # the last step's events, while the device runs this one
        readout = self._read(out, rows)
        read = time.perf_counter()
        decode_only = all(row.start >= item.prompt_len for item, row in rows)
        self.steps += 1
        self.prefill_steps += not decode_only
        first = np.cumsum([0] + [len(row.tokens) if row.all_logits else 1 for _, row in rows])
        for (item, row), at in zip(rows, first):
            if item.ended:  # a queued step's row of a request that ended before it: its token is dropped
                continue
            try:
                self._advance(item, row, readout, int(at))
            except RequestFault as e:
                self._finish(item, "error", str(e), fault="request")
            self._send_gained(item)
        if not self._overlap or not self.running:
            self._flush()
        if self.speculation is not None and decode_only:
            self.speculation.observe(sum(len(row.tokens) for _, row in rows), time.perf_counter() - began)
        if self.profile is not None:
            device = timer.seconds if timer is not None else None
            prompt = sum(len(row.tokens) for item, row in rows if row.start < item.prompt_len)
            times = (launched - began, read - launched, time.perf_counter() - read, device, began)
            self.profile.append(StepProfile(len(rows), sum(len(r.tokens) for _, r in rows), *times, prompt))
        self.busy += time.perf_counter() - began

    def _launch(self) -> tuple[list[tuple[_Running, Row]], Any, Any]:
        """This step's rows, output and device timer: the step the last one queued, or a new one."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and any(not item.ended for item, _ in ahead[0]):
            self.steps_ahead += 1
            return ahead
        rows = self._rows()
        if not rows:
            return rows, None, None
        if self._overlap and any(len(row.tokens) > 1 and not row.all_logits for _, row in rows):
            self._flush()  # a step with a prompt chunk is slow to launch: the last step's tokens go out first
        timer = self.backend.timer() if self.profile is not None else None
        with timer or contextlib.nullcontext():
            out = self._forward(rows, Batch([r for _, r in rows]))
        return rows, out, timer

    def _forward(self, rows: list[tuple[_Running, Row]], batch: Batch) -> Any:
        """The step's logits; a proposer that reads the target's hidden states gets each speculating row's."""
        proposer = self.speculation.proposer if self.speculation is not None else None
        if proposer is None or not proposer.reads_hidden:
            return self.backend.run(self.model.architecture.forward, batch, self.kv)
        logits, hidden = proposer.forward_hidden(batch, self.kv)
        for (item, row), offset in zip(rows, batch.offsets):
            if item.speculation is not None:
                span = self.backend.take_rows(hidden, offset + np.arange(len(row.tokens)))
                proposer.observe(item.handle.id, row.start, row.tokens, span, int(offset))
        return logits

    def _queue_next(self, rows: list[tuple[_Running, Row]], ids: Any) -> None:
        """Queue the next step before this one's tokens reach the host: a decode row for each request that will
        still be decoding, its token this step's argmax taken on the device. Only when this step is every running
        request's plain decode row (none drafts), and no request waits for a free slot (it would wait a step more)."""
        if len(rows) != len(self.running) or (self.waiting and self.free_slots) or self._embedding:
            return
        if any(len(row.tokens) != 1 or row.start < item.prompt_len or item.speculation for item, row in rows):
            return  # a prompt chunk, a draft, or a request that may draft: the next step is decided on the host
        following, index = [], []
        for at, (item, row) in enumerate(rows):
            if item.generated + 1 >= item.request.max_tokens:
                continue  # ends by length at this step
            self.budget.pages_for(item.held, item.slot, row.start + 1, row.start + 2)
            following.append((item, Row(item.slot, row.start + 1, np.zeros(1, np.int64))))
            index.append(at)
        if following:
            batch = Batch([r for _, r in following])
            timer = self.backend.timer() if self.profile is not None else None
            with timer or contextlib.nullcontext():
                out = self.backend.run(self.model.architecture.forward, batch, self.kv, fed=(ids, np.asarray(index)))
            self._ahead = (following, out, timer)

    def _post(self, handle: RequestHandle, event: Event) -> None:
        self._outbox.append((handle, event))

    def _flush(self) -> None:
        events, self._outbox = self._outbox, []
        if events:
            deliver(events)

    def _rows(self) -> list[tuple[_Running, Row]]:
        """This step's rows: a decode token (and its draft) per decoding request, prefill chunks within budget."""
        image = self._image_row()
        if image is not None:
            return [image]
        rows: list[tuple[_Running, Row]] = []
        budget = self.prefill_budget  # prompt tokens this step may still take
        for item in list(self.running):
            if item.filled < item.prompt_len:
                end = min(
                    next_chunk(item.filled, item.filled + self.prefill_chunk, item.request.images)[0], item.prompt_len
                )
                if end - item.filled > budget:
                    continue
                budget -= end - item.filled
            else:
                end = item.filled + 1
                try:
                    item.draft = self._propose(item)
                except RequestFault as e:
                    self._finish(item, "error", str(e), fault="request")
                    continue
            self.budget.pages_for(item.held, item.slot, item.filled, end + len(item.draft))
            span = np.asarray(item.tokens[item.filled : end] + item.draft)
            rows.append((item, Row(item.slot, item.filled, span, all_logits=bool(item.draft))))
        return rows

    def _image_row(self) -> tuple[_Running, Row] | None:
        """The row of the first image a prompt has reached: a step of its own, since its inputs are the image's
        embeddings rather than token ids, and its positions see each other (:class:`leat.batch.Row`)."""
        for item in self.running:
            end, image = next_chunk(item.filled, item.filled, item.request.images)
            if image is not None:
                self.budget.pages_for(item.held, item.slot, item.filled, end)
                inputs = self.model.vision.embeddings(image, item.filled)
                span = np.asarray(item.tokens[item.filled : end])
                return item, Row(item.slot, item.filled, span, bidirectional=True, inputs=inputs)
        return None

    def _read(self, out: Any, rows: list[tuple[_Running, Row]]) -> _Readout:
        """The least of the step's output that every row needs brought to the host."""
        wants = [self._candidates(item, row) for item, row in rows]
        if all(want == 0 or self._plain_greedy(item, row) for want, (item, row) in zip(wants, rows)):
            # only token ids cross to the host (a device backend's argmax), not rows x vocabulary logits
            ids = self.backend.argmax_async(out)
            if self._pipeline:
                self._queue_next(rows, ids)
            return _Readout(chosen=ids.result())
        known = [want for want in wants if want is not None]
        if self.top_k_candidates and len(known) == len(wants):
            # rows x K candidates cross to the host instead of rows x vocabulary logits
            return _Readout(candidates=self.backend.top_k(out, max(known)), vocab=out.shape[-1])
        return _Readout(logits=self.backend.to_host(out))

    def _advance(self, item: _Running, row: Row, readout: _Readout, at: int) -> None:
        """Take the row's result: a verified draft, the next token, or (a prefill chunk) only the KV it wrote.
        ``at`` is the row's first position in the step's output."""
        if item.draft:
            self._verify_row(item, row, readout, at)
            return
        item.filled = row.start + len(row.tokens)
        if item.filled < len(item.tokens):
            return
        if readout.logits is not None:
            self._sample(item, readout.logits[at])
        elif readout.candidates is not None and not self._plain_greedy(item, row):
            self._sample(item, self._candidate_row(readout.candidates, at, readout.vocab))
        else:  # the argmax ids, or a plain greedy row's first candidate
            self._take(item, int(readout.argmax()[at]))

    def _candidates(self, item: _Running, row: Row) -> int | None:
        """How many of the row's top logits (by value, ties to the lower id) give exactly the token a whole
        row would: 0 when the row samples nothing this step (a prefill chunk before the prompt's last), 1
        for plain greedy, K when the chain's first stage keeps only the top K (``Stage.keeps_top``), K at most
        MAX_CANDIDATES, and nothing else reads the logits; None when it needs the whole row.

        Why top-K candidates are exact: the chain's stages run in order on the float64 row and the first
        one here (top_k) keeps the row's K largest logits (equal ones by lower id) and sets the
        rest to -inf. A row that is -inf outside a candidate set of the K >= top_k largest, chosen by the
        same rule, has the same top_k largest with the same values, so top_k leaves the two rows equal;
        every later stage (top_p, min_p, temperature) and the selector then see the same row and draw the
        same random numbers. Penalties (which may lift a token from outside the top k) come before top_k
        in the chain, so a chain with them does not begin with top_k; processors and logprobs read the
        whole row, and speculative verification every position's.
        """
        if not item.draft and row.start + len(row.tokens) < len(item.tokens):
            return 0
        if self._plain_greedy(item, row):
            return 1
        sampler, request = item.sampler, item.request
        if sampler.greedy or request.processors or request.logprobs is not None or row.all_logits:
            return None
        k = sampler.stages[0].keeps_top() if sampler.stages else None
        return k if k is not None and 1 <= k <= MAX_CANDIDATES else None

    @staticmethod
    def _candidate_row(candidates: tuple[np.ndarray, np.ndarray], at: int, vocab: int) -> np.ndarray:
        """A logits row that is the candidates' values at their ids and -inf elsewhere."""
        values, ids = candidates
        row = np.full(vocab, -np.inf, values.dtype)
        row[ids[at]] = values[at]
        return row

    @staticmethod
    def _plain_greedy(item: _Running, row: Row) -> bool:
        """Whether the row's token is the argmax of its logits and nothing else reads them."""
        sampler, request = item.sampler, item.request
        return sampler.greedy and not sampler.stages and not request.processors and request.logprobs is None

    # -- speculation: a decoding row carries draft tokens, verified against every position's logits --
    def _propose(self, item: _Running) -> list[int]:
        # a request has a controller only where the engine has speculation; verification knows no processors
        speculation = self.speculation
        if item.speculation is None or speculation is None or item.request.processors:
            return []
        # the draft never runs past max_tokens, so the pages reserved at admission always cover it
        decoding = sum(1 for other in self.running if other.filled >= other.prompt_len)
        k = item.speculation.draft_length(lambda extra: speculation.cost(decoding, extra))
        k = min(k, item.request.max_tokens - item.generated - 1)
        if k <= 0:
            return []
        proposer = speculation.proposer
        try:
            return [int(t) for t in proposer.propose(item.handle.id, item.tokens, k)[:k]]
        except Exception as e:
            raise RequestFault(f"drafting ({proposer.name or _name(proposer)})", e) from e

    def _verify_row(self, item: _Running, row: Row, readout: _Readout, at: int) -> None:
        if readout.logits is None:  # plain greedy: the argmax at every position is all verification needs
            ids = readout.argmax()[at : at + len(row.tokens)]
            self._verify(item, row, accept_greedy(item.draft, [int(t) for t in ids]))
            return
        span = readout.logits[at : at + len(row.tokens)]
        try:
            new = verify(item.sampler, item.tokens, item.draft, span)
        except Exception as e:
            raise RequestFault("verifying the draft", e) from e
        self._verify(item, row, new, span)

    def _verify(self, item: _Running, row: Row, new: list[int], logits: np.ndarray | None = None) -> None:
        """Take the tokens one verification gained (the accepted draft prefix and one more); ``logits``, every
        position's, where the request reads them (logprobs)."""
        if item.speculation is not None:  # a row drafts only with a controller
            item.speculation.record(len(item.draft), len(new) - 1)
        item.draft = []
        for i, token in enumerate(new):
            item.filled = row.start + 1 + i  # the accepted draft tokens before this one are in the KV
            self._take(item, token, None if logits is None else logits[i])
            if item.ended:
                return

    def _speculation_stats(self) -> dict[str, int]:
        totals = dict(self._finished_speculation)
        for item in self.running:
            if item.speculation is not None:
                for key in totals:
                    totals[key] += getattr(item.speculation, key)
        return totals

    # -- a request's new token -------------------------------------------------------------------------
    def _sample(self, item: _Running, logits: np.ndarray) -> None:
        """Sample the request's next token from its ``logits`` row, and take it."""
        self._take(item, self._choose(item, logits), logits)

    def _take(self, item: _Running, token: int, logits: np.ndarray | None = None) -> None:
        """Take ``token`` (``logits``: its position's row, where it came to the host); end the request at end of
        generation or max_tokens."""
        item.tokens.append(token)
        if item.first_token_at is None:
            item.first_token_at = time.perf_counter()
        if self.model.tokenizer.is_eog(token) and not item.request.ignore_eos:
            self._finish(item, "stop")
            return
        if item.request.logprobs is not None:
            self._gain_logprobs(item, logits, token, item.request.logprobs)
        item.gained.append(token)
        if item.generated >= item.request.max_tokens:
            self._finish(item, "length")

    @staticmethod
    def _choose(item: _Running, logits: np.ndarray) -> int:
        """The request's processors, then its sampler, on one logits row."""
        if item.request.processors:
            logits = np.asarray(logits, dtype=np.float64)
            for process in item.request.processors:
                try:
                    logits = process(logits, item.tokens[item.prompt_len :])
                except Exception as e:
                    label = getattr(process, "label", None)
                    raise RequestFault(label or f"logits processor {_name(process)}", e) from e
        try:
            return item.sampler.sample(logits, item.tokens)
        except Exception as e:
            raise RequestFault("sampling", e) from e

    @staticmethod
    def _gain_logprobs(item: _Running, logits: np.ndarray | None, token: int, k: int) -> None:
        """The token's log-probability, and the ``k`` most likely tokens' (k > 0), from its position's logits."""
        try:
            if logits is None:  # a request that reads logprobs has its rows' logits brought to the host
                raise ValueError("no logits came to the host for this position")
            logp = log_softmax(logits)
            item.gained_logprobs.append(float(logp[token]))
            if k > 0:
                top = _top(logp, k)
                item.gained_top.append([(int(t), float(logp[t])) for t in top])
        except Exception as e:
            raise RequestFault("logprobs", e) from e

    def _send_gained(self, item: _Running) -> None:
        """One event with the tokens (and logprobs) the request gained since the last."""
        if not item.gained:
            return
        logprobs, top = item.request.logprobs is not None, bool(item.request.logprobs)
        event = Event(
            "tokens",
            ids=item.gained,
            logprobs=item.gained_logprobs if logprobs else None,
            top_logprobs=item.gained_top if top else None,
        )
        item.gained, item.gained_logprobs, item.gained_top = [], [], []
        self._post(item.handle, event)

    def _usage(self, item: _Running) -> dict[str, int]:
        return {
            "prompt_tokens": item.prompt_len,
            "completion_tokens": max(0, len(item.tokens) - item.prompt_len),
            "cached_tokens": item.cached,
        }

    def _finish(self, item: _Running, reason: str, error: str | None = None, fault: str | None = None) -> None:
        """End the request: its pages and slot go back, it gets its last event ("error" with ``error``)."""
        self._send_gained(item)
        item.ended = True
        self.budget.remember(item.held, item.filled)
        if item.request.session:
            kept = keyed(item.tokens[: item.filled], item.request.images)
            self.session_kv.keep(item.request.session, kept, item.held.pages, failed=reason == "error")
        self.budget.release(item.held)
        if item.speculation is not None and self.speculation is not None:
            self.speculation.proposer.forget(item.handle.id)
            for key, total in self._finished_speculation.items():
                self._finished_speculation[key] = total + getattr(item.speculation, key)
        self.running.remove(item)
        self.free_slots.append(item.slot)
        now = time.perf_counter()
        timings = {
            "ttft_seconds": (item.first_token_at or now) - item.submitted,
            "total_seconds": now - item.submitted,
        }
        if error is not None:
            self._post(item.handle, Event("error", error=error, fault=fault, usage=self._usage(item)))
        else:
            self._post(item.handle, Event("done", finish_reason=reason, usage=self._usage(item), timings=timings))


def _name(process: Any) -> str:
    return getattr(process, "__name__", None) or type(process).__name__


def _top(logp: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest values, largest first (equal ones by lower id)."""
    if k >= len(logp):
        return np.lexsort((np.arange(len(logp)), -logp))
    part = np.argpartition(-logp, k - 1)[:k]
    return part[np.lexsort((part, -logp[part]))]
