"""Issue #19: named sessions over HTTP. A real ``leat serve`` with two API keys and a session store: a session is
created, continued, forked, hibernated, the server restarted (as an engine process with an API frontend, so the
session calls cross the process protocol), restored and continued, with the same answers as the sessions that
never left memory; another key can neither see nor touch it."""

from __future__ import annotations

import httpx
import pytest
from leat.keys import KeyStore
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess

HISTORY = [{"role": "user", "content": "tell me a story about a lighthouse keeper and the sea"}]


@pytest.fixture(scope="module")
def setup(leat_home):
    home = leat_home()
    model = write_tiny_gguf(Llama, home / "tiny.gguf", params=Llama.tiny(context=1024))
    store = KeyStore(home / "keys.json")
    keys = {"alice": store.add("alice"), "bob": store.add("bob")}
    args = ["--backend", "cpu", "--batch-size", "2", "--api-key-file", str(store.path)]
    args += ["--session-store", str(home / "sessions")]
    return model, args, keys, home


def client(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def chat(http: httpx.Client, session: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "session": session}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def turn(first: dict, text: str) -> list[dict]:
    return HISTORY + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": text},
    ]


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_fork_hibernate_restart_restore_continue(setup):
    model, args, keys, home = setup
    with ServerProcess(model, args, env={"LEAT_HOME": str(home)}) as server, client(server, keys["alice"]) as alice:
        first = chat(alice, "story", HISTORY)
        told = alice.get("/v1/sessions/story").json()
        assert told["id"] == "story" and told["tokens"] >= first["usage"]["prompt_tokens"]
        forked = alice.post("/v1/sessions/story/fork", json={"id": "story-2"})
        assert forked.status_code == 201 and forked.json()["tokens"] == told["tokens"]
        assert alice.post("/v1/sessions/story/fork", json={"id": "story-2"}).status_code == 409
        # the answers of sessions that stay in memory: copies of both, continued with different turns
        for source, copy in (("story", "story-ref"), ("story-2", "story-2-ref")):
            assert alice.post(f"/v1/sessions/{source}/fork", json={"id": copy}).status_code == 201
        red = chat(alice, "story-ref", turn(first, "make it red"))
        blue = chat(alice, "story-2-ref", turn(first, "make it blue, and much longer than the red one"))
        lengths = {s["id"]: s["tokens"] for s in alice.get("/v1/sessions").json()["data"]}
        assert lengths["story-ref"] != lengths["story-2-ref"]  # the forks diverged
        assert lengths["story"] == lengths["story-2"] == told["tokens"]  # and their sources did not move
        for name in ("story", "story-2"):
            slept = alice.post(f"/v1/sessions/{name}/hibernate")
            assert slept.status_code == 200 and slept.json()["hibernated"] is True
        woke = alice.post("/v1/sessions/story/restore").json()
        assert woke["hibernated"] is False and woke["tokens"] == told["tokens"]
        assert alice.post("/v1/sessions/story/hibernate").json()["hibernated"] is True

    with (
        ServerProcess(model, [*args, "--api-workers", "1"], env={"LEAT_HOME": str(home)}, timeout=120) as server,
        client(server, keys["alice"]) as alice,
        client(server, keys["bob"]) as bob,
    ):
        after = {s["id"]: s for s in alice.get("/v1/sessions").json()["data"]}
        assert after["story"]["hibernated"] and after["story"]["tokens"] == told["tokens"]
        assert after["story-2"]["hibernated"] and after["story-2"]["tokens"] == told["tokens"]
        # another key sees none of them, and every route answers it as if they did not exist
        assert bob.get("/v1/sessions").json()["data"] == []
        assert bob.get("/v1/sessions/story").status_code == 404
        for route in ("hibernate", "restore"):
            assert bob.post(f"/v1/sessions/story/{route}").status_code == 404
        assert bob.post("/v1/sessions/story/fork", json={"id": "mine"}).status_code == 404
        assert bob.delete("/v1/sessions/story").status_code == 404
        assert bob.get("/v1/sessions").json()["data"] == []

        restored = alice.post("/v1/sessions/story-2/restore")
        assert restored.status_code == 200 and restored.json()["hibernated"] is False
        again_red = chat(alice, "story", turn(first, "make it red"))  # restored by the request itself
        assert cached(again_red) >= first["usage"]["prompt_tokens"] - 1  # the history is not prefilled again
        again_blue = chat(alice, "story-2", turn(first, "make it blue, and much longer than the red one"))
        assert cached(again_blue) >= first["usage"]["prompt_tokens"] - 1
        assert again_red["choices"][0]["message"] == red["choices"][0]["message"]
        assert again_blue["choices"][0]["message"] == blue["choices"][0]["message"]

        assert alice.delete("/v1/sessions/story").status_code == 200
        assert alice.get("/v1/sessions/story").status_code == 404
        assert "story" not in {s["id"] for s in alice.get("/v1/sessions").json()["data"]}


def test_create_and_bad_names(setup):
    model, args, keys, home = setup
    with ServerProcess(model, args, env={"LEAT_HOME": str(home)}) as server, client(server, keys["bob"]) as bob:
        made = bob.post("/v1/sessions", json={"id": "notes"})
        assert made.status_code == 201 and made.json() == {
            "id": "notes",
            "object": "session",
            "tokens": 0,
            "hibernated": False,
        }
        again = bob.post("/v1/sessions", json={"id": "notes"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "session_exists"
        assert again.json()["error"]["type"] == "invalid_request_error"  # before: "server_error", for a client's clash
        first = chat(bob, "notes", HISTORY)
        assert bob.get("/v1/sessions/notes").json()["tokens"] >= first["usage"]["prompt_tokens"]
        second = chat(bob, "notes", turn(first, "go on"))
        assert cached(second) >= first["usage"]["prompt_tokens"] - 1
        # Anthropic Messages take the same extension field
        body = {"model": "tiny", "max_tokens": 4, "messages": turn(first, "go on"), "session": "notes"}
        third = bob.post("/v1/messages", json=body | {"temperature": 0})
        assert third.status_code == 200 and third.json()["usage"]["cache_read_input_tokens"] >= cached(second)

        too_long = "x" * 120  # with keys on, the owner id takes 17 of the 128 characters
        # "." and "..": made, a session that no URL could name (clients resolve dot segments) to hibernate or delete
        for body in (
            {"id": "../keys"},
            {"id": ""},
            {"id": too_long},
            {"id": 3},
            {},
            {"id": "a", "extra": 1},
            {"id": ".."},
        ):
            r = bob.post("/v1/sessions", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["message"]
        for path in ("/v1/sessions/bad%20name", f"/v1/sessions/{too_long}", "/v1/sessions/%2E%2E%2Fkeys"):
            r = bob.get(path)
            assert r.status_code in (400, 404), (path, r.text)
            assert r.json()["error"]["message"]
        assert bob.get("/v1/sessions/bad%20name").status_code == 400
        assert bob.post("/v1/sessions/notes/fork", json={"id": "no/slash"}).status_code == 400
        assert bob.post("/v1/sessions/notes/fork", content=b"not json").status_code == 400
        assert bob.post("/v1/sessions/absent/restore").status_code == 404
        names = {s["id"] for s in bob.get("/v1/sessions").json()["data"]}
        assert names == {"notes"}
