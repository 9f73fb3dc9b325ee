"""Which replica a request goes to: the one that holds its prefix or session, unless that one is busier than the
least loaded by more than a threshold; requests without a long enough prefix go to the least loaded.

The preferred replica is chosen by rendezvous hashing of the request's key over the running replicas' ids: no
table to keep or share, so every ingress replica picks the same replica for the same prefix, and when a replica
comes or goes only the keys it held move. A key is a session's name, or the first ``prefix_chars`` characters of
the prompt's text (system prompt and messages in order), salted by the caller's API key because leat scopes
prefix-cache entries and sessions by key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

PREFIX_CHARS = 256  # the characters of a prompt that pick its replica; a shorter prompt goes to the least loaded
SESSIONS = "/v1/sessions/"
IMBALANCE = 4  # requests the preferred replica may have beyond the least loaded before the least loaded gets it


@dataclass
class ProxiedRequest:
    """One HTTP request as the ingress hands it to a replica; ``key`` is what routes it (None: least loaded)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    key: str | None = None
    client: tuple[str, int] | None = None


@dataclass
class ResponseStart:
    """The first item a replica yields: the status and headers; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def _text(content: Any) -> str:
    """The text of a message's content: a string, or the text of its parts (OpenAI and Anthropic shapes)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part) for part in content)
    if isinstance(content, dict):
        for name in ("text", "content", "input_text"):
            if name in content:
                return _text(content[name])
    return "" if content is None else str(content)


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """What a request's prompt starts with, as text, for the routes that generate; '' for the others."""
    parts: list[str] = []
    if path in ("/v1/messages", "/v1/responses"):
        parts.append(_text(body.get("system")) + _text(body.get("instructions")))
    if path in ("/v1/chat/completions", "/v1/messages"):
        for message in body.get("messages") or []:
            if isinstance(message, dict):
                parts.append(f"{message.get('role', '')}\x00{_text(message.get('content'))}")
    elif path == "/v1/completions":
        prompt = body.get("prompt")
        parts.append(" ".join(map(str, prompt)) if isinstance(prompt, list) else _text(prompt))
    elif path == "/v1/responses":
        parts.append(_text(body.get("input")))
    return "\x01".join(parts)


def routing_key(path: str, body: bytes, owner: str, prefix_chars: int = PREFIX_CHARS) -> str | None:
    """The key that picks a request's replica: its session, or the first ``prefix_chars`` of its prompt's text;
    None when it has neither (not JSON, not a generating route, a short prompt): the least loaded then serves it.
    ``owner`` is whatever names the caller's API key (''); requests of different keys share no cache.
    ``/v1/sessions/NAME`` and its sub-routes (fork, hibernate, restore) go where that session's requests go, and
    ``POST /v1/sessions`` where the new session's will (a fork lives beside its source: its own requests are routed
    by its own name, so they may reach another replica)."""
    if path.startswith(SESSIONS):
        return f"session\x00{owner}\x00{path[len(SESSIONS) :].split('/')[0]}"
    try:
        decoded = msgspec.json.decode(body) if body else None
    except msgspec.DecodeError:
        return None  # the replica answers its 400
    if not isinstance(decoded, dict):
        return None
    session = decoded.get("id") if path == SESSIONS.rstrip("/") else decoded.get("session")
    if isinstance(session, str) and session:
        return f"session\x00{owner}\x00{session}"
    text = prompt_text(path, decoded)
    if len(text) < prefix_chars:
        return None
    return f"prefix\x00{owner}\x00{text[:prefix_chars]}"


def owner_of(headers: list[tuple[bytes, bytes]]) -> str:
    """A digest of the request's API key (''): the same key gives the same owner, and the key itself is not kept."""
    found = {k.lower(): v for k, v in headers if k.lower() in (b"authorization", b"x-api-key")}
    key = found.get(b"x-api-key") or found.get(b"authorization", b"")
    return hashlib.blake2b(key, digest_size=8).hexdigest() if key else ""


def preferred(key: str, replica_ids: list[str]) -> str:
    """The replica id rendezvous hashing gives ``key``: the one whose hash with the key is highest."""
    return max(replica_ids, key=lambda rid: hashlib.blake2b(f"{key}\x02{rid}".encode(), digest_size=8).digest())
