"""The routing key a request gets and the replica rendezvous hashing gives it, without Ray running."""

import collections
import json

from leat_ray.routing import owner_of, preferred, prompt_text, routing_key

SYSTEM = "You are a careful assistant. " * 12


def chat(*messages, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages), **extra}).encode()


def test_requests_sharing_a_long_prefix_share_a_key_and_differ_from_others():
    a = routing_key(
        "/v1/chat/completions", chat({"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}), ""
    )
    b = routing_key(
        "/v1/chat/completions", chat({"role": "system", "content": SYSTEM}, {"role": "user", "content": "b"}), ""
    )
    other = routing_key("/v1/chat/completions", chat({"role": "system", "content": "Be terse. " + SYSTEM}), "")
    assert a is not None and a == b and other != a


def test_the_same_prompt_in_openai_parts_and_anthropic_shape_is_read_as_text():
    parts = [{"type": "text", "text": SYSTEM}]
    openai_body = chat({"role": "user", "content": parts})
    anthropic_body = json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]})
    assert SYSTEM in prompt_text("/v1/chat/completions", json.loads(openai_body))
    assert SYSTEM in prompt_text("/v1/messages", json.loads(anthropic_body))
    assert routing_key("/v1/messages", anthropic_body.encode(), "") is not None


def test_short_prompts_bad_bodies_and_other_routes_have_no_key():
    assert routing_key("/v1/completions", json.dumps({"prompt": "hi"}).encode(), "") is None
    assert routing_key("/v1/completions", b"{not json", "") is None
    assert routing_key("/tokenize", json.dumps({"content": SYSTEM}).encode(), "") is None
    assert routing_key("/v1/completions", json.dumps({"prompt": SYSTEM}).encode(), "") is not None


def test_a_session_is_its_key_whatever_its_prompt_and_keys_are_per_api_key():
    one = routing_key("/v1/chat/completions", chat({"role": "user", "content": "x"}, session="s1"), "o")
    two = routing_key("/v1/chat/completions", chat({"role": "user", "content": SYSTEM}, session="s1"), "o")
    assert one == two and one != routing_key("/v1/chat/completions", chat(session="s1"), "p")
    assert routing_key("/v1/sessions/s1", b"", "o") == one  # deleting it goes where it lives
    assert routing_key("/v1/sessions/s1/hibernate", b"", "o") == one  # and so do its other routes
    assert routing_key("/v1/sessions", json.dumps({"id": "s1"}).encode(), "o") == one  # as does creating it
    alice = owner_of([(b"authorization", b"Bearer alice")])
    assert alice == owner_of([(b"Authorization", b"Bearer alice")]) != owner_of([(b"x-api-key", b"bob")])
    assert owner_of([]) == "" and "alice" not in alice


def test_rendezvous_spreads_keys_and_moves_only_a_lost_replicas_keys():
    replicas = ["r1", "r2", "r3", "r4"]
    keys = [f"prefix\x00\x00{i} {SYSTEM}" for i in range(2000)]
    placed = {k: preferred(k, replicas) for k in keys}
    counts = collections.Counter(placed.values())
    assert set(counts) == set(replicas) and min(counts.values()) > 400  # about 500 each
    after = {k: preferred(k, ["r1", "r2", "r4"]) for k in keys}
    moved = [k for k in keys if after[k] != placed[k]]
    assert moved and all(placed[k] == "r3" for k in moved)
