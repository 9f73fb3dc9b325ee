"""The Python API: ``leat.load(path_or_name)`` -> :class:`Model` with tokenize, logits, generate."""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from leat import plugins
from leat.architecture import Architecture
from leat.backend import Backend
from leat.batch import Batch, Row
from leat.errors import BackendUnavailable, LeatError, UnknownArchitecture
from leat.modelfile import ModelFile
from leat.options import EngineOptions
from leat.textstream import TextStream

PREFILL_CHUNK = EngineOptions.prefill_chunk  # prompt tokens per forward where no engine runs (logits, bench)


def pooling_type(file: ModelFile) -> gguf.PoolingType:
    """The pooling the GGUF states (``{arch}.pooling_type``), mean where it states none."""
    stated = file.get(gguf.Keys.LLM.POOLING_TYPE, None)
    try:
        return gguf.PoolingType(int(stated)) if stated is not None else gguf.PoolingType.MEAN
    except ValueError:
        raise LeatError(f"this model's pooling type {stated} is none that GGUF defines") from None


def rerank_prompt(file: ModelFile, tokenizer: Any, query: str, document: str) -> list[int]:
    """The prompt a reranker scores ``document`` for ``query`` by, as llama-server builds it (format_prompt_rerank):
    the file's ``tokenizer.chat_template.rerank`` with ``{query}`` and ``{document}`` replaced, special tokens
    parsed and none added; without one, [BOS] query [EOS] [SEP] document [EOS], each special token where the
    tokenizer adds it, the texts tokenized without special tokens (EOS is SEP where the model has no EOS)."""
    template = file.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE_N.format(name="rerank"), None)
    if template is not None:
        text = template.replace("{query}", query).replace("{document}", document)
        return tokenizer.encode(text, add_special=False, parse_special=True)
    end = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    eos, sep = ([end] if tokenizer.add_eos else []), ([tokenizer.sep_id] if tokenizer.add_sep else [])
    if None in bos + eos + sep:
        raise LeatError("this reranker's tokenizer adds a BOS, EOS or SEP token it does not have")
    words = [tokenizer.encode(text, add_special=False) for text in (query, document)]
    return bos + words[0] + eos + sep + words[1] + eos


def architecture_class(file: ModelFile, host: plugins.PluginHost | None = None) -> type[Architecture]:
    host = host or plugins.host()
    entry = host.get("architectures", file.architecture)
    if entry is None:
        installed = ", ".join(sorted(host.registry["architectures"])) or "none"
        elsewhere = host.only is not None and plugins.PluginHost(None, kinds=("architectures",)).get(
            "architectures", file.architecture
        )
        where = (
            f"; the installed plugin {elsewhere.plugin} serves it: add it to LEAT_PLUGINS / --plugins"
            if elsewhere
            else "; install the architecture plugin that serves it"
        )
        failed = [p.name for p in host.failed()]
        broken = f"; plugins that failed to load: {', '.join(failed)}" if failed else ""
        raise UnknownArchitecture(
            f"{file.path.name}: architecture {file.architecture!r} is not served by any installed plugin "
            f"(installed: {installed}){where}{broken}"
        )
    return entry.load()


def choose_backend(name: str | None, host: plugins.PluginHost | None = None) -> type[Backend]:
    """The named backend, or the usable one with the highest priority."""
    host = host or plugins.host()
    table = host.registry["backends"]
    if name is not None:
        if name not in table:
            raise BackendUnavailable(f"no backend named {name!r}; installed: {', '.join(sorted(table)) or 'none'}")
        cls = table[name].load()
        reason = cls.probe()
        if reason:
            raise BackendUnavailable(f"backend {name} cannot run here: {reason}")
        return cls
    reasons = []
    for entry in sorted(table.values(), key=lambda e: -int(e.options.get("priority", 0))):
        try:
            cls = entry.load()
        except LeatError as e:  # a broken backend plugin must not hide the working ones
            reasons.append(f"{entry.name}: {e}")
            continue
        reason = cls.probe()
        if reason is None:
            return cls
        reasons.append(f"{entry.name}: {reason}")
    raise BackendUnavailable("no usable backend installed" + (f" ({'; '.join(reasons)})" if reasons else ""))


@dataclass
class Token:
    """One generated token and the text it completes (may be empty while UTF-8 is incomplete, or while it may be
    the start of a stop string). A last ``Token(-1, text)`` carries text held back until the end."""

    id: int
    text: str


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV was reused (not computed)
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_seconds": round(self.prompt_seconds, 6),
            "cached_tokens": self.cached_tokens,
            "prompt_tokens_per_second": _rate(self.prompt_tokens - self.cached_tokens, self.prompt_seconds),
            "generated_tokens": self.generated_tokens,
            "generate_seconds": round(self.generate_seconds, 6),
            # the first token comes with the prompt; the decode rate counts the ones after it
            "generate_tokens_per_second": _rate(max(self.generated_tokens - 1, 0), self.generate_seconds),
            "finish_reason": self.finish_reason,
        }


def _rate(n: int, seconds: float) -> float | None:
    return round(n / seconds, 3) if seconds > 0 else None


class Model:
    """A loaded model: file, architecture on a backend, tokenizer and chat template."""

    def __init__(self, file: ModelFile, architecture: Architecture, backend: Backend, text: Any = None):
        """``text``: the (tokenizer, chat template) pair of :func:`text_parts`, when already built; a template of None
        is read from the file when first used."""
        self.file = file
        self.architecture = architecture
        self.backend = backend
        self.tokenizer, template = text or (tokenizer_of(file), None)
        if template is not None:
            self.chat_template = template
        self.last_timings = Timings()
        self._session_engine = None
        self.speculation = None  # a leat.speculative.Speculation the engines of generate() use (--speculate)
        self.vision: Any = None  # a leat.vision.Vision once an mmproj is loaded (load_mmproj)

    def load_mmproj(self, path: str | Path) -> None:
        """Load the vision projector ``path`` (an mmproj GGUF) beside the model, so that prompts may hold images."""
        from leat.vision import Vision

        projectors = type(self.architecture).projectors
        if not projectors:
            raise LeatError(f"the {self.file.architecture} architecture takes no images: no --mmproj for it")
        self.vision = Vision(path, self.backend, self.architecture.params.width, projectors)

    def image_prompt(self, text: str, images: Sequence[bytes], add_special: bool = True) -> tuple[list[int], list]:
        """Token ids and image spans of ``text`` holding one ``leat.vision.MARKER`` per image (encoded bytes)."""
        if self.vision is None:
            raise LeatError("this model has no vision projector: load one with --mmproj")
        return self.vision.prompt(self.tokenizer, text, images, add_special)

    @functools.cached_property
    def chat_template(self) -> Any:
        """The file's chat template, built when first used: plain completion does without it (and jinja2's 5 MiB)."""
        from leat.chat import ChatTemplate

        return ChatTemplate.from_metadata(self.file.metadata)

    @property
    def context_length(self) -> int:
        return self.architecture.context_length

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def new_kv(self, context: int, slots: int = 1, dtype: str = "f32") -> Any:
        layouts = self.architecture.kv_layouts(self.architecture.params)
        return self.backend.allocate_kv(layouts, slots, context, dtype=dtype)

    def logits(self, token_ids: Sequence[int], native: bool = False, images: Sequence[Any] = ()) -> np.ndarray:
        """Logits at every position of a fresh sequence: [len(token_ids), vocab], float32 unless ``native``;
        ``images``: the image spans of :meth:`image_prompt`."""
        logits = self._every_position(self.architecture.forward, token_ids, images)
        return logits if native else logits.astype(np.float32)

    def hidden(self, token_ids: Sequence[int]) -> np.ndarray:
        """The final-normed hidden state at every position of a fresh sequence: [len(token_ids), width], float64
        (:meth:`Architecture.hidden`; a LeatError for a family without it)."""
        if type(self.architecture).hidden is Architecture.hidden:
            raise LeatError(f"the {self.file.architecture} architecture plugin gives no hidden states: no embeddings")
        return self._every_position(self.architecture.hidden, token_ids).astype(np.float64)

    def _every_position(self, forward: Any, token_ids: Sequence[int], images: Sequence[Any] = ()) -> np.ndarray:
        """``forward``'s output at every position of a fresh sequence, run in prefill chunks (an image's span one
        chunk). Called directly, not through ``Backend.run``: a cache used once gains nothing from a captured
        graph, and would capture one per call."""
        from leat.vision import next_chunk

        ids = np.asarray(token_ids, dtype=np.int64)
        self._check_tokens(ids)
        kv = self.new_kv(len(ids))
        out, start = [], 0
        while start < len(ids):
            end, image = next_chunk(start, min(start + PREFILL_CHUNK, len(ids)), images)
            inputs = self.vision.embeddings(image) if image is not None else None
            row = Row(0, start, ids[start:end], all_logits=True, bidirectional=image is not None, inputs=inputs)
            out.append(self.backend.to_host(forward(Batch([row]), kv)))
            start = end
        return np.concatenate(out)

    @property
    def pooling(self) -> str:
        """How :meth:`embed` pools positions: the GGUF's ``pooling_type`` (mean, cls or last; mean when it has none),
        or rank for a reranker (:meth:`rank`); a LeatError for none, which gives no single vector."""
        kind = pooling_type(self.file)
        if kind not in (gguf.PoolingType.MEAN, gguf.PoolingType.CLS, gguf.PoolingType.LAST, gguf.PoolingType.RANK):
            raise LeatError(f"this model's pooling type is {kind.name.lower()}: it gives no single embedding")
        return kind.name.lower()

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """One embedding of the sequence: its hidden states pooled as :attr:`pooling` says, L2-normalized; float32."""
        if self.pooling == "rank":
            raise LeatError("this model is a reranker (pooling type rank): it scores documents for a query, not embeds")
        states = self.hidden(token_ids)
        pooled = {"mean": lambda: states.mean(axis=0), "cls": lambda: states[0], "last": lambda: states[-1]}
        vector = pooled[self.pooling]()
        return (vector / max(float(np.linalg.norm(vector)), 1e-12)).astype(np.float32)

    def rank(self, token_ids: Sequence[int]) -> np.ndarray:
        """A reranker's label probabilities for one prompt (:func:`rerank_prompt`), float64: the softmax of the
        classifier head times the last position's hidden state, as llama.cpp's causal rerankers (Qwen3-Reranker,
        labels ["yes", "no"]) score; the relevance score llama-server reports is the first label's."""
        if self.pooling != "rank" or self.architecture.classifier is None:
            raise LeatError(f"this model's pooling type is {self.pooling}, not rank: it is no reranker")
        logits = self.architecture.classifier.astype(np.float64) @ self.hidden(token_ids)[-1]
        weights = np.exp(logits - logits.max())
        return weights / weights.sum()

    def _check_tokens(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            raise LeatError("no tokens to evaluate")
        vocab = self.architecture.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise LeatError(f"token id out of range for this model's vocabulary of {vocab}")

    def chat_prompt(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=True, **extra)
        # The template writes BOS itself when the model wants one, so only special tokens are parsed here.
        return self.tokenize(text, add_special=False, parse_special=True)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        sampling: Any = None,
        stop: Sequence[str] = (),
        context: int | None = None,
        session: str | None = None,
        images: Sequence[Any] = (),
    ) -> Iterator[Token]:
        """Stream tokens after ``prompt`` (text is tokenized with BOS as the model wants), ending before the
        first of ``stop`` (that token comes with the text before the stop string). ``images``: encoded images, one
        for each ``leat.vision.MARKER`` in a text prompt, or with token ids the spans :meth:`image_prompt` gave.

        Runs a single-slot :class:`~leat.engine.Engine` and a :class:`~leat.textstream.TextStream`, so this path
        and the server's share one implementation. With ``session``, the engine stays up between calls and a
        prompt that extends the previous conversation prefills only what is new.
        """
        from leat.engine import GenerationRequest

        spans: list[Any] = []
        if images and not isinstance(prompt, str):
            ids, spans = list(prompt), list(images)  # the ids and spans of image_prompt
        elif images:
            ids, spans = self.image_prompt(prompt, images)
        else:
            ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_tokens(np.asarray(ids))
        engine, max_tokens = self._engine_for(len(ids), max_tokens, context, session)
        try:
            handle = engine.submit(GenerationRequest(ids, max_tokens, sampling, session=session, images=spans))
            yield from self._read(handle, TextStream(self.tokenizer, stop), Timings(prompt_tokens=len(ids)))
        finally:
            if engine is not self._session_engine:
                engine.stop()

    def _engine_for(
        self, prompt_tokens: int, max_tokens: int, context: int | None, session: str | None
    ) -> tuple[Any, int]:
        """The engine a generate() call runs on (the session's, kept running, or its own) and its max_tokens."""
        from leat.engine import Engine

        if session is not None and self._session_engine is None:
            self._session_engine = Engine(self, EngineOptions(batch_size=1), speculation=self.speculation).start()
        limit = min(context or self.context_length, self.context_length)
        if session is not None:
            limit = min(limit, self._session_engine.max_context)
        if prompt_tokens >= limit:
            raise LeatError(f"prompt of {prompt_tokens} tokens does not fit the context of {limit} tokens")
        max_tokens = min(max_tokens, limit - prompt_tokens)
        if session is not None:
            return self._session_engine, max_tokens
        options = EngineOptions(batch_size=1, max_context=prompt_tokens + max_tokens)
        engine = Engine(self, options, speculation=self.speculation)
        return engine.start(), max_tokens

    def _read(self, handle: Any, text: TextStream, timings: Timings) -> Iterator[Token]:
        """The request's tokens with their text, until its text stops; then the text held back, as Token(-1, ...)."""
        self.last_timings = timings
        try:
            for event in handle:
                if event.kind == "error":
                    raise LeatError(f"generation failed: {event.error}")
                if event.kind == "done":
                    tail = text.flush()
                    if tail:
                        yield Token(-1, tail)
                    _record(timings, event, text)
                    return
                for token in event.ids:
                    if text.stopped:
                        break
                    piece = text.feed((token,))
                    if text.stopped:
                        handle.cancel()  # the engine ends the request at its next step; its "done" still comes
                    timings.generated_tokens += 1
                    yield Token(token, piece)
        finally:
            handle.cancel()

    def close(self) -> None:
        """Stop the engine that sessions keep running, if any."""
        if self._session_engine is not None:
            self._session_engine.stop()
            self._session_engine = None


def _record(timings: Timings, done: Any, text: TextStream) -> None:
    """Fill ``timings`` from the engine's "done" event (its usage counts the end-of-generation token too)."""
    timings.finish_reason = "stop" if text.stopped else done.finish_reason
    if not text.stopped:
        timings.generated_tokens = done.usage["completion_tokens"]
    timings.cached_tokens = done.usage["cached_tokens"]
    seconds = done.timings or {}
    timings.prompt_seconds = seconds.get("ttft_seconds", 0.0)
    timings.generate_seconds = seconds.get("total_seconds", 0.0) - timings.prompt_seconds


def load(
    model: str,
    backend: str | None = None,
    precision: str = "f32",
    pull: bool = True,
    host: plugins.PluginHost | None = None,
    backend_options: dict[str, Any] | None = None,
    tensor_parallel: int = 1,
) -> Model:
    """Load ``model`` (a path, or a name ``leat pull`` understands) on ``backend`` (None: best usable), whose
    constructor also gets ``backend_options`` (e.g. the cpu backend's ``activations="ggml"``); ``tensor_parallel``
    above 1 splits it over that many backends of the kind (:mod:`leat.parallel`)."""
    from leat.pull import resolve

    path = resolve(model, pull=pull)
    file = ModelFile(path)
    arch_cls = architecture_class(file, host)
    backend_cls = choose_backend(backend, host)
    if tensor_parallel > 1:
        from leat.parallel import TensorParallel, check_split

        check_split(arch_cls, file, tensor_parallel)
        backend_obj: Backend = TensorParallel.of(backend_cls, tensor_parallel, precision, **(backend_options or {}))
    else:
        backend_obj = backend_cls(precision=precision, **(backend_options or {}))
    # the tokenizer (pure Python) is built while the weights go to the device (the copies release the GIL)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="leat-tokenizer") as pool:
        tokenizer = pool.submit(tokenizer_of, file)
        architecture = arch_cls(file, backend_obj)
        return Model(file, architecture, backend_obj, (tokenizer.result(), None))


def tokenizer_of(file: ModelFile) -> Any:
    """The tokenizer a file describes."""
    from leat.tokenizer import Tokenizer

    return Tokenizer.from_metadata(file.metadata)


def text_parts(file: ModelFile) -> tuple[Any, Any]:
    """The tokenizer and chat template a file describes."""
    from leat.chat import ChatTemplate

    return tokenizer_of(file), ChatTemplate.from_metadata(file.metadata)
