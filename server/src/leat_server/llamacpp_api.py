"""llama-server's own endpoints (not OpenAI's): ``POST /completion`` (also ``/completions``), ``POST /apply-template``
and ``GET /props``, in the shapes llama.cpp's server README gives them, so that tools written for llama-server talk to
``leat serve`` unchanged.

``/completion`` takes a prompt as text, token ids, or both mixed (``[12, 34, "text", 56]``), or a list of such prompts
(an answer each, in order), llama.cpp's sampling fields (those leat has; the rest only at their neutral values),
``n_predict``, ``stop``, ``grammar`` (GBNF), ``json_schema``, ``logit_bias`` in either of its shapes, ``n_probs`` and
``return_tokens``; it answers ``content``, ``stop_type`` (``eos``, ``limit``, ``word``), ``stopping_word``,
``timings``, ``tokens_evaluated``, ``tokens_cached``, ``generation_settings`` and, with ``n_probs``,
``completion_probabilities``. Streamed, as llama-server streams: ``data:`` events of ``content`` and ``tokens``, the
last one whole with ``stop: true``, and no ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from leat import __version__
from leat.plugins import host as plugin_host
from leat.sampling import fields as sampling_fields

from leat_server import constrained, fim
from leat_server.errors import bad_request, unsupported
from leat_server.images import Images
from leat_server.openai_api import MAX_CHOICES, choice_seed, sse, stop_list, template_messages
from leat_server.schemas import Body, ChatMessage, Seed
from leat_server.service import Job, Service, TokenLogprob

#: llama-server's samplers that leat has not, and the value at which each does nothing (accepted)
NEUTRAL = {
    "typical_p": 1.0,
    "mirostat": 0,
    "dynatemp_range": 0.0,
    "dry_multiplier": 0.0,
    "t_max_predict_ms": 0,
    "n_indent": 0,
}


class CompletionRequest(Body):
    prompt: str | list[Any] = ""  # text, ids and text mixed, or a list of prompts (checked by _prompts)
    n_predict: int = -1
    stream: bool = False
    stop: list[str] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    logit_bias: list[list[Any]] | dict[str, float] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_probs: int = 0
    return_tokens: bool = False
    n_cmpl: int = 1
    post_sampling_probs: bool = False
    lora: list[dict[str, Any]] | None = None
    typical_p: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    t_max_predict_ms: int | None = None
    n_indent: int | None = None
    # accepted with no effect: llama-server's scheduling and cache settings (leat's engine decides them)
    cache_prompt: bool | None = None
    id_slot: int | None = None
    n_keep: int | None = None
    min_keep: int | None = None
    n_cache_reuse: int | None = None
    timings_per_token: bool | None = None
    samplers: list[str] | None = None
    model: str | None = None


class InfillRequest(CompletionRequest):
    """``/infill``: the code before the cursor and after it, other files' chunks, and the prompt (text after the
    prefix), with /completion's fields."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict[str, Any]] | None = None


class ApplyTemplateRequest(Body):
    messages: list[ChatMessage]
    model: str | None = None


SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "xtc_probability",
    "xtc_threshold",
    "seed",
)


def _prompts(service: Service, prompt: str | list[Any]) -> list[list[int]]:
    """Each prompt's token ids. A prompt is text, or token ids and text mixed (``[12, 34, "text", 56]``); a list of
    texts, or a list holding lists, is several prompts. Text is tokenized with BOS as the model wants it where it
    begins the prompt; ids are checked."""
    several = (
        isinstance(prompt, list)
        and bool(prompt)
        and (all(isinstance(p, str) for p in prompt) or any(isinstance(p, list) for p in prompt))
    )
    items: list[Any] = list(prompt) if several else [prompt]
    vocab = service.model.architecture.vocab_size
    out = []
    for item in items:
        parts = [item] if isinstance(item, str) else item
        if not isinstance(parts, list):
            raise bad_request("prompt: give text, token ids, a list mixing both, or a list of those", "prompt")
        ids: list[int] = []
        for j, part in enumerate(parts):
            if isinstance(part, str):
                ids += service.tokenizer.encode(part, add_special=j == 0, parse_special=True)
            elif isinstance(part, int) and not isinstance(part, bool) and 0 <= part < vocab:
                ids.append(part)
            else:
                raise bad_request(
                    f"prompt: {part!r} is not text or a token id of this model (0..{vocab - 1})", "prompt"
                )
        if not ids:
            raise bad_request("prompt is empty", "prompt")
        out.append(ids)
    return out


def _bias(service: Service, bias: list[list[Any]] | dict[str, float] | None) -> list:
    """llama-server's ``logit_bias``: ``[[token, bias], ...]`` (a token id or a string, whose tokens all get it;
    ``false`` bans it) or OpenAI's ``{"id": bias}``."""
    if bias is None or isinstance(bias, dict):
        return service.logit_bias(bias)
    table: dict[str, float] = {}
    for i, pair in enumerate(bias):
        if len(pair) != 2 or not isinstance(pair[1], bool | int | float) or pair[1] is True:
            raise bad_request(f"logit_bias[{i}] must be [token or text, bias or false]", "logit_bias")
        value = -100.0 if pair[1] is False else float(pair[1])
        token = pair[0]
        ids = [token] if isinstance(token, int) else service.tokenizer.encode(str(token), add_special=False)
        for t in ids:
            table[str(t)] = value
    return service.logit_bias(table)


def completion_jobs(service: Service, body: CompletionRequest, owner: str | None) -> list[Job]:
    return _jobs(service, body, owner, _prompts(service, body.prompt))


def infill_jobs(service: Service, body: InfillRequest, owner: str | None) -> list[Job]:
    if not isinstance(body.prompt, str):
        raise bad_request("prompt must be text here (it follows the prefix)", "prompt")
    ids = fim.prompt(
        service, body.input_prefix, body.input_suffix, body.input_extra, body.prompt, body.n_predict, "input_prefix"
    )
    return _jobs(service, body, owner, [ids])


def _jobs(service: Service, body: CompletionRequest, owner: str | None, prompts: list[list[int]]) -> list[Job]:
    for name, neutral in NEUTRAL.items():
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise unsupported(name, f"this server has no {name} sampler; leave it at {neutral} or out")
    if body.post_sampling_probs:
        raise unsupported("post_sampling_probs", "probabilities are given before sampling (logprobs)")
    if body.lora:
        raise unsupported("lora", "LoRA adapters are not supported")
    if not 0 <= body.n_probs <= 20:
        raise bad_request("n_probs must be in 0..20", "n_probs")
    if not 1 <= body.n_cmpl or len(prompts) * body.n_cmpl > MAX_CHOICES:
        raise bad_request(f"prompts times n_cmpl must be 1..{MAX_CHOICES}", "n_cmpl")
    if body.grammar is not None and body.json_schema is not None:
        raise bad_request("give grammar or json_schema, not both", "grammar")
    known = sampling_fields(plugin_host())  # the loaded sampler stages' fields
    fields = {name: getattr(body, name) for name in SAMPLING}
    missing = [name for name, value in fields.items() if value is not None and name not in known]
    if missing:
        raise unsupported(missing[0], "no installed sampler takes it")
    jobs = []
    for ids in prompts:
        for index in range(body.n_cmpl):
            choice = {**fields, "seed": choice_seed(fields["seed"], index)}
            processors = _bias(service, body.logit_bias)
            if body.grammar is not None or body.json_schema is not None:
                param = "grammar" if body.grammar is not None else "json_schema"
                if not service.supports("processors"):
                    raise unsupported(param, "constrained output needs per-request logits processors")
                kind, value = ("grammar", body.grammar) if body.grammar is not None else ("json", body.json_schema)
                processors.append(constrained.processor(service, value, param, kind))
            jobs.append(
                Job(
                    endpoint="completion",
                    prompt_ids=ids,
                    max_tokens=body.n_predict if body.n_predict >= 0 else None,
                    sampling=service.sampling(choice),
                    stop=stop_list(body.stop),
                    # a stream's token ids come with its tokens' logprobs (0 alternatives: no more is computed)
                    logprobs=body.n_probs if body.n_probs else (0 if body.stream and body.return_tokens else None),
                    ignore_eos=body.ignore_eos,
                    processors=processors,
                    owner=owner,
                )
            )
    return jobs


def _probabilities(lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "id": lp.id,
            "token": lp.text,
            "logprob": lp.logprob,
            "bytes": list(lp.text.encode()),
            "top_logprobs": [{"id": i, "token": t, "logprob": v, "bytes": list(t.encode())} for i, t, v in lp.top],
        }
        for lp in lps
    ]


def _stop_type(job: Job) -> str:
    r = job.result
    if r.finish_reason == "length":
        return "limit"
    return "word" if r.stop_sequence is not None else "eos"


def _timings(job: Job) -> dict[str, Any]:
    r = job.result
    first = r.timings.get("ttft_seconds", 0.0) * 1e3
    generating = max(0.0, r.timings.get("total_seconds", 0.0) * 1e3 - first)
    prompt_n, predicted_n = r.prompt_tokens - r.cached_tokens, r.completion_tokens
    return {
        "prompt_n": prompt_n,
        "prompt_ms": first,
        "prompt_per_token_ms": first / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / first * 1e3 if first else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": generating,
        "predicted_per_token_ms": generating / predicted_n if predicted_n else 0.0,
        "predicted_per_second": predicted_n / generating * 1e3 if generating else 0.0,
    }


def settings(service: Service, job: Job | None = None) -> dict[str, Any]:
    """llama-server's ``generation_settings``: the context, the model and the request's (or the default) sampling."""
    sampling = (job.sampling if job is not None else service.sampling({})).as_dict()
    return {
        "n_ctx": service.max_context,
        "model": service.name,
        **sampling,
        "n_predict": job.max_tokens if job is not None and job.max_tokens is not None else -1,
        "stop": list(job.stop) if job is not None else [],
    }


def completion_body(service: Service, job: Job, index: int, body: CompletionRequest) -> dict[str, Any]:
    r = job.result
    answer: dict[str, Any] = {
        "index": index,
        "content": r.content,
        "tokens": list(r.token_ids) if body.return_tokens else [],
        "id_slot": 0,
        "stop": True,
        "model": service.name,
        "tokens_predicted": r.completion_tokens,
        "tokens_evaluated": r.prompt_tokens,
        "generation_settings": settings(service, job),
        "prompt": service.tokenizer.decode(job.prompt_ids, skip_special=False),
        "has_new_line": "\n" in r.content,
        "truncated": False,
        "stop_type": _stop_type(job),
        "stopping_word": r.stop_sequence or "",
        "tokens_cached": r.cached_tokens,
        "timings": _timings(job),
    }
    if body.n_probs:
        answer["completion_probabilities"] = _probabilities(r.logprobs)
    return answer


async def completion_stream(
    service: Service, jobs: list[Job], handles: list[Any], body: CompletionRequest
) -> AsyncIterator[bytes]:
    several = len(jobs) > 1
    async for index, piece in service.stream_all(jobs, handles):
        if not (piece.text or piece.logprobs):
            continue
        chunk: dict[str, Any] = {
            "content": piece.text,
            "tokens": [lp.id for lp in piece.logprobs] if body.return_tokens else [],
            "stop": False,
            "id_slot": 0,
        }
        if several:
            chunk["index"] = index
        if body.n_probs:
            chunk["completion_probabilities"] = _probabilities(piece.logprobs)
        yield sse(chunk)
    for index, job in enumerate(jobs):
        final = completion_body(service, job, index, body) | {"content": ""}
        if not several:
            final.pop("index")
        yield sse(final)


def apply_template(service: Service, body: ApplyTemplateRequest, owner: str | None) -> dict[str, Any]:
    images = Images()
    messages = template_messages(body.messages, images)
    text, _, _ = service.render_chat(messages, None, {}, images)
    return {"prompt": text}


def props(service: Service, slots: int) -> dict[str, Any]:
    vision = getattr(service.model, "vision", None) is not None
    return {
        "default_generation_settings": {"id": 0, "n_ctx": service.max_context, "params": settings(service)},
        "total_slots": slots,
        "model_path": str(service.model.file.path),
        "model_alias": service.name,
        "chat_template": service.model.chat_template.source or "",
        "modalities": {"vision": vision, "audio": False},
        "build_info": f"leat {__version__}",
    }
