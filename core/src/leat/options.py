"""The engine's options and their defaults, defined once: :class:`~leat.engine.Engine`, ``leat serve``
(:class:`leat_server.ServeOptions`) and the CLI's flags take theirs from :class:`EngineOptions`.

This module imports nothing heavy, so the CLI can read the defaults before it loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineOptions:
    """How an engine sizes its KV cache and schedules requests.

    ``max_context`` None: the longest context whose KV for every slot fits ``kv_budget_bytes`` (None: what the
    backend offers), up to the model's. ``prefill_budget`` None: the backend's prompt tokens per step.
    ``window_pages`` False gives sliding-window layers pages for the whole context, as the others (llama.cpp's
    --swa-full); by default they hold only what their window still needs. ``top_k_candidates`` False makes
    sampled requests always fetch whole logit rows (see :meth:`leat.engine.Engine.step`). ``profile`` records a
    :class:`~leat.engine.StepProfile` of every step in ``Engine.profile``. ``pipeline`` lets the engine queue a
    decode step before the last one's tokens reach the host, where the backend feeds tokens on the device
    (:attr:`leat.backend.Backend.feeds_tokens`).
    """

    batch_size: int = 8  # requests decoded together: the batch slots
    max_context: int | None = None  # tokens per request: prompt plus max_tokens
    kv: str = "f32"  # KV storage: f32, f16 or q8_0
    prefill_chunk: int = 512  # the most prompt tokens of one prompt in a step
    prefill_budget: int | None = None  # the most prompt tokens of a step, over several prompts
    page_size: int = 16  # tokens per KV page
    max_queue: int = 64  # requests that may wait beyond the free batch slots before new ones are refused
    kv_budget_bytes: int | None = None
    session_store: str | None = None  # directory where sessions hibernate and outlive the process
    window_pages: bool = True
    top_k_candidates: bool = True
    profile: bool = False
    pipeline: bool = True


#: Tokens a request may generate when it does not say, as in OpenAI's API: a chat answer runs until the model
#: stops or the context is full (None), a plain completion stops after 16 (``leat run`` and ``leat generate``,
#: and the server's chat and completions bodies).
CHAT_MAX_TOKENS: int | None = None
COMPLETION_MAX_TOKENS = 16
