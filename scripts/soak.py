"""A soak test of `leat serve` (not run in CI): many requests at once, some clients going away mid-answer, some
requests the server must refuse, then a check that nothing was lost and nothing leaked.

    uv run python scripts/soak.py --requests 1000 --concurrency 64 --max-tokens 16

It starts ``leat serve MODEL --backend BACKEND --batch-size N`` on 127.0.0.1 (a free port; no traffic goes anywhere
else), warms it up with ``--concurrency`` healthy requests at once, reads the engine's KV pages (``GET /metrics``) and the server's resident memory
(``/proc/PID/status`` VmRSS, summed over its child processes), then sends ``--requests`` requests, ``--concurrency`` at a time: a mix of the four
generation APIs (chat completions, completions, Anthropic messages, responses), streamed and not. Of those:

* every ``--poison-every``-th is poisoned (a JSON schema nothing satisfies, a logit_bias token id past the
  vocabulary, max_tokens past the context, a body that is not JSON, an image part): it must get a 4xx;
* a ``--disconnect-rate`` share of the others are dropped by their client: after a random number of SSE events (a
  stream) or a random delay (a whole answer), the socket is closed, half of the time with a reset;
* every other request is healthy and must get a complete, well-formed answer.

Once the server is idle again it checks: no healthy request lost (no answer, a timeout, a cut-off stream), none
failed (an error status or in-band error event, a malformed answer), every poisoned one a 4xx, no 5xx at all, and
the KV pages requests hold (in use less those the prefix cache keeps) back where they were. (With
``--serve-args "--api-workers N"`` the HTTP counters it reports are those of whichever API process answered
``/metrics``; the engine's figures are whole.) It prints one JSON line,
then a table, and exits 1 if a check failed. Every loop is bounded: each request by ``--timeout``, the server's
start by ``--start-timeout``, the wait for it to go idle by ``--idle-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HOST = "127.0.0.1"
KINDS = ("chat", "completions", "messages", "responses")
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "List three prime numbers.",
    "Explain what a hash table is in one sentence.",
    "Tell me a joke about computers.",
    "Translate 'good morning' into Spanish.",
]
POISONS = ("impossible_schema", "logit_bias_out_of_range", "max_tokens_past_context", "not_json", "image_part")


@dataclass
class Outcome:
    index: int
    kind: str
    stream: bool
    role: str  # "healthy" | "disconnect" | "poisoned"
    poison: str | None = None
    status: int | None = None
    ok: bool = False  # healthy: complete and well formed; poisoned: a 4xx; disconnect: always (any ending is fine)
    error: str | None = None  # why not ok
    lost: bool = False  # healthy and no complete answer (transport error, timeout, cut-off stream)
    seconds: float = 0.0
    events: int = 0


@dataclass
class Plan:
    index: int
    kind: str
    stream: bool
    role: str
    poison: str | None = None
    body: dict[str, Any] | bytes = field(default_factory=dict)
    cut_after_events: int = 0  # disconnect, streamed
    cut_after_seconds: float = 0.0  # disconnect, whole
    reset: bool = False  # disconnect with a TCP reset instead of a close


# --- the server -------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not answer /health within {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` and its descendants (with --api-workers: the supervisor, the engine and the API processes)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone since
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0
    for member in tree:
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def scrape(url: str) -> dict[str, float]:
    """The Prometheus samples of ``GET /metrics`` as {"name{labels}": value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                pass
    return samples


def engine_state(url: str) -> dict[str, float]:
    m = scrape(url)
    state = {key: m.get(f"leat_{key}", 0.0) for key in ("running", "queue_depth", "kv_pages_used", "kv_pages_cached")}
    state["kv_pages_held"] = state["kv_pages_used"] - state["kv_pages_cached"]
    pages = m.get("leat_kv_pages_total", 0.0)
    state["kv_page_bytes"] = m.get('leat_allocated_bytes{kind="kv"}', 0.0) / pages if pages else 0.0
    state["cancelled"] = sum(v for k, v in m.items() if k.startswith("leat_requests_cancelled_total{"))
    by_status: dict[str, float] = {}
    for key, value in m.items():
        match = re.match(r'leat_http_requests_total\{path="(/v1/[^"]*)",status="(\d+)"\}', key)  # not /metrics
        if match:
            by_status[match.group(2)] = by_status.get(match.group(2), 0.0) + value
    state["http"] = by_status
    return state


def wait_idle(url: str, timeout: float) -> tuple[dict[str, float], float]:
    start = time.monotonic()
    while True:
        state = engine_state(url)
        if state["running"] == 0 and state["queue_depth"] == 0:
            return state, time.monotonic() - start
        if time.monotonic() - start > timeout:
            return state, time.monotonic() - start
        time.sleep(0.05)


# --- requests ---------------------------------------------------------------------------------------------------


def healthy_body(
    kind: str, stream: bool, rng: random.Random, max_tokens: int, model: str, unique: float
) -> dict[str, Any]:
    prompt = rng.choice(PROMPTS)
    if rng.random() < unique:
        prompt = f"{prompt} (request {rng.randrange(1_000_000)})"  # a prompt the prefix cache has not seen
    sampling = {"temperature": 0.0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randrange(1 << 30)}
    messages = [{"role": "user", "content": prompt}]
    if kind == "chat":
        body = {"messages": messages, "max_tokens": max_tokens, **sampling}
    elif kind == "completions":
        body = {"prompt": prompt, "max_tokens": max_tokens, **sampling}
    elif kind == "messages":
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": min(sampling["temperature"], 1.0)}
    else:
        body = {"input": prompt, "max_output_tokens": max_tokens, "temperature": sampling["temperature"]}
    return {"model": model, "stream": stream, **body}


def poisoned_body(kind: str, poison: str, body: dict[str, Any]) -> dict[str, Any] | bytes:
    """``body`` made into one the server must refuse with a 4xx."""
    if poison == "not_json":
        return json.dumps(body).encode()[:-7] + b"{{]"
    if poison == "max_tokens_past_context":
        key = "max_output_tokens" if kind == "responses" else "max_tokens"
        return {**body, key: 10_000_000}
    if poison == "image_part":
        image = (
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}}
            if kind == "messages"
            else {"type": "input_image", "image_url": "http://127.0.0.1:9/x.png"}
            if kind == "responses"
            else {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}
        )
        if kind == "completions":
            return {**body, "prompt": [[1, 2, 3], [4, 5]]}  # two prompts in one request: refused
        if kind == "responses":
            return {**body, "input": [{"role": "user", "content": [image]}]}
        return {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]}
    if kind in ("messages", "responses"):  # no response_format or logit_bias there: an impossible schema instead
        schema = {"type": "string", "minLength": 5, "maxLength": 2}
        if kind == "responses":
            return {**body, "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
        return {**body, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    if poison == "impossible_schema":
        schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}}
        return {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    return {**body, "logit_bias": {"999999999": 5}}


def make_plans(args: argparse.Namespace, model: str, count: int, seed: int, healthy: bool = False) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    poisons = 0
    for i in range(count):
        kind = rng.choice(KINDS)
        stream = rng.random() < 0.5
        body = healthy_body(kind, stream, rng, args.max_tokens, model, args.unique_prompts)
        if healthy:
            plans.append(Plan(i, kind, stream, "healthy", body=body))
        elif args.poison_every and i % args.poison_every == args.poison_every - 1:
            poison = POISONS[poisons % len(POISONS)]
            poisons += 1
            plans.append(Plan(i, kind, stream, "poisoned", poison, poisoned_body(kind, poison, body)))
        elif rng.random() < args.disconnect_rate:
            plan = Plan(i, kind, stream, "disconnect", body=body, reset=rng.random() < 0.5)
            plan.cut_after_events = rng.randrange(0, args.max_tokens + 2)
            plan.cut_after_seconds = rng.uniform(0.0, args.disconnect_delay)
            plans.append(plan)
        else:
            plans.append(Plan(i, kind, stream, "healthy", body=body))
    return plans


def check_whole(kind: str, answer: Any, max_tokens: int) -> str | None:
    """Why a whole (non-streamed) answer is malformed, or None."""
    if not isinstance(answer, dict):
        return "the answer is not a JSON object"
    if kind == "chat":
        choice = (answer.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        if answer.get("object") != "chat.completion" or message.get("role") != "assistant":
            return "not a chat.completion"
        if not isinstance(message.get("content"), str) and not message.get("tool_calls"):
            return "no content"
        if choice.get("finish_reason") not in ("stop", "length", "tool_calls"):
            return f"finish_reason {choice.get('finish_reason')!r}"
        used = (answer.get("usage") or {}).get("completion_tokens", -1)
    elif kind == "completions":
        choice = (answer.get("choices") or [{}])[0]
        if answer.get("object") != "text_completion" or not isinstance(choice.get("text"), str):
            return "not a text_completion"
        if choice.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {choice.get('finish_reason')!r}"
        used = (answer.get("usage") or {}).get("completion_tokens", -1)
    elif kind == "messages":
        if answer.get("type") != "message" or not isinstance(answer.get("content"), list):
            return "not a message"
        if answer.get("stop_reason") not in ("end_turn", "max_tokens", "stop_sequence", "tool_use"):
            return f"stop_reason {answer.get('stop_reason')!r}"
        used = (answer.get("usage") or {}).get("output_tokens", -1)
    else:
        if answer.get("object") != "response" or answer.get("status") not in ("completed", "incomplete"):
            return f"not a finished response (status {answer.get('status')!r})"
        used = (answer.get("usage") or {}).get("output_tokens", -1)
    if not 0 <= used <= max_tokens:
        return f"{used} output tokens for max_tokens {max_tokens}"
    return None


def check_events(kind: str, events: list[tuple[str | None, str]]) -> tuple[str | None, bool]:
    """(why a stream's events are malformed or report an error, or None; whether the stream is complete)."""
    datas = [data for _, data in events]
    if kind in ("chat", "completions"):
        if not datas or datas[-1] != "[DONE]":
            return "the stream does not end with [DONE]", False
        finish = None
        for data in datas[:-1]:
            chunk = json.loads(data)
            if "error" in chunk:
                return f"in-band error: {chunk['error'].get('message')}", True
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
        if finish not in ("stop", "length", "tool_calls"):
            return f"no finish_reason (last {finish!r})", True
        return None, True
    types = []
    for name, data in events:
        chunk = json.loads(data)
        if name == "error" or chunk.get("type") in ("error", "response.failed"):
            return f"in-band error: {data[:200]}", True
        types.append(chunk.get("type"))
    if kind == "messages":
        if not types or types[-1] != "message_stop":
            return "the stream does not end with message_stop", False
        if types[0] != "message_start" or "message_delta" not in types:
            return "no message_start or message_delta", True
        return None, True
    if not types or types[-1] not in ("response.completed", "response.incomplete"):
        return "the stream does not end with response.completed", False
    if types[0] != "response.created":
        return "no response.created", True
    return None, True


def sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):  # not splitlines(): U+2028 and its kind may be in the JSON as they are
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            events.append((name, "\n".join(data)))
    return events


async def send_http(client: httpx.AsyncClient, plan: Plan, out: Outcome, max_tokens: int) -> None:
    """A healthy or poisoned request, read to its end."""
    path = PATHS[plan.kind]
    content = plan.body if isinstance(plan.body, bytes) else json.dumps(plan.body).encode()
    headers = {"Content-Type": "application/json"}
    streamed = plan.stream and plan.role == "healthy"
    try:
        if streamed:
            async with client.stream("POST", path, content=content, headers=headers) as response:
                out.status = response.status_code
                text = (await response.aread()).decode()
        else:
            response = await client.post(path, content=content, headers=headers)
            out.status = response.status_code
            text = response.text
    except (httpx.TransportError, httpx.StreamError) as e:
        out.error = f"{type(e).__name__}: {e}"
        out.lost = plan.role == "healthy"
        return
    if plan.role == "poisoned":
        out.ok = 400 <= out.status < 500
        if not out.ok:
            out.error = f"status {out.status}: {text[:200]}"
        return
    if out.status != 200:
        out.error = f"status {out.status}: {text[:200]}"
        return
    try:
        if streamed:
            events = sse_events(text)
            out.events = len(events)
            out.error, complete = check_events(plan.kind, events)
            out.lost = not complete
        else:
            out.error = check_whole(plan.kind, json.loads(text), max_tokens)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        out.error = f"malformed: {type(e).__name__}: {e}"
    out.ok = out.error is None


async def send_and_drop(port: int, plan: Plan, out: Outcome, timeout: float) -> None:
    """A request whose client goes away: after ``cut_after_events`` SSE events or ``cut_after_seconds``."""
    data = json.dumps(plan.body).encode()
    head = (
        f"POST {PATHS[plan.kind]} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
    try:
        writer.write(head + data)
        await writer.drain()
        if plan.stream:
            seen = b""
            deadline = time.monotonic() + timeout
            while seen.count(b"\n\n") < plan.cut_after_events + 1 and time.monotonic() < deadline:  # +1: headers
                chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
                if not chunk:
                    break
                seen += chunk
            out.events = max(0, seen.count(b"\n\n") - 1)
        else:
            try:
                await asyncio.wait_for(reader.read(1), plan.cut_after_seconds)
            except TimeoutError:
                pass
    except (OSError, TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"  # counted, not failed: this client was leaving anyway
    finally:
        if plan.reset:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 5)
        except (OSError, TimeoutError):
            pass
    out.ok = True


async def run_load(args: argparse.Namespace, url: str, port: int, plans: list[Plan]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    queue: asyncio.Queue[Plan] = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(plan)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:

        async def worker() -> None:
            while True:
                try:
                    plan = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                out = Outcome(plan.index, plan.kind, plan.stream, plan.role, plan.poison)
                start = time.perf_counter()
                try:
                    if plan.role == "disconnect":
                        await asyncio.wait_for(send_and_drop(port, plan, out, args.timeout), args.timeout + 10)
                    else:
                        await asyncio.wait_for(send_http(client, plan, out, args.max_tokens), args.timeout + 10)
                except TimeoutError:
                    out.error = f"no answer within {args.timeout:.0f} s"
                    out.lost = plan.role == "healthy"
                    out.ok = plan.role == "disconnect"
                out.seconds = time.perf_counter() - start
                outcomes.append(out)
                if args.verbose and not out.ok:
                    print(f"  #{out.index} {out.kind} stream={out.stream} {out.role}: {out.error}", file=sys.stderr)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return sorted(outcomes, key=lambda o: o.index)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="what `leat serve` serves [default]")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--serve-args", default="", help="more `leat serve` options, one string")
    parser.add_argument("--requests", type=int, default=1000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, each followed by a reading of pages and RSS")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--disconnect-rate", type=float, default=0.2, help="share of the other requests dropped")
    parser.add_argument("--disconnect-delay", type=float, default=2.0, help="most seconds before a whole one drops")
    parser.add_argument("--poison-every", type=int, default=50)
    parser.add_argument(
        "--unique-prompts",
        type=float,
        default=0.5,
        help="share of prompts made unique (the others repeat, so the prefix cache stops growing)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--idle-timeout", type=float, default=60.0, help="seconds the server may take to go idle")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=None, help="the server's output (default: a temporary file)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each failure as it happens")
    args = parser.parse_args()

    port = free_port()
    url = f"http://{HOST}:{port}"
    log_path = Path(args.log or tempfile.mkstemp(prefix="leat-soak-", suffix=".log")[1])
    max_queue = max(64, args.concurrency)  # nothing is refused as overload: a 429 would count as a failure
    command = [sys.executable, "-m", "leat", "serve", args.model, "--host", HOST, "--port", str(port)]
    command += ["--backend", args.backend, "--batch-size", str(args.batch_size), "--max-queue", str(max_queue)]
    command += args.serve_args.split()
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = wait_ready(url, server, args.start_timeout)
        model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())["data"][0]["id"]
        # a full batch first, so the memory a batch of this size needs is there before the first reading
        warm = asyncio.run(run_load(args, url, port, make_plans(args, model, args.concurrency, args.seed + 1, True)))
        if not all(o.ok for o in warm):
            raise SystemExit(f"warming up failed: {next(o.error for o in warm if not o.ok)}")
        before, _ = wait_idle(url, args.idle_timeout)
        rss_before = rss_mb(server.pid)
        outcomes, rounds, wall = [], [], 0.0
        for r in range(args.rounds):
            plans = make_plans(args, model, args.requests, args.seed + 1000 * r)
            start = time.perf_counter()
            outcomes += asyncio.run(run_load(args, url, port, plans))
            wall += time.perf_counter() - start
            after, idle_seconds = wait_idle(url, args.idle_timeout)
            rss_after = rss_mb(server.pid)
            held, cached = int(after["kv_pages_held"]), int(after["kv_pages_cached"])
            rounds.append({"rss_mb": round(rss_after, 1), "kv_pages_held": held, "kv_pages_cached": cached})
            if after["running"] or after["queue_depth"]:
                break  # not idle: the check below fails
        alive = server.poll() is None
        serving_log = log_path.read_text(errors="replace")  # before the stop: shutdown has its own messages
    finally:
        stop(server)
    tracebacks = serving_log.count("Traceback")
    shutdown_tracebacks = log_path.read_text(errors="replace").count("Traceback") - tracebacks

    by_role = {role: [o for o in outcomes if o.role == role] for role in ("healthy", "disconnect", "poisoned")}
    healthy, poisoned = by_role["healthy"], by_role["poisoned"]
    lost = [o for o in healthy if o.lost]
    collateral = [o for o in healthy if not o.ok and not o.lost]
    poisoned_4xx = sum(o.ok for o in poisoned)
    client_5xx = sum(1 for o in outcomes if o.status is not None and o.status >= 500)
    server_http = {k: int(after["http"].get(k, 0) - before["http"].get(k, 0)) for k in after["http"]}
    server_5xx = sum(v for k, v in server_http.items() if k.startswith("5"))
    idle_after = after["running"] == 0 and after["queue_depth"] == 0
    summary = {
        "model": args.model,
        "backend": args.backend,
        "batch_size": args.batch_size,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "requests": len(outcomes),
        "healthy": len(healthy),
        "disconnected": len(by_role["disconnect"]),
        "poisoned": len(poisoned),
        "lost": len(lost),
        "collateral_failures": len(collateral),
        "poisoned_4xx": poisoned_4xx,
        "responses_5xx": client_5xx,
        "server_5xx": server_5xx,
        "server_statuses": dict(sorted(server_http.items())),
        "server_cancelled": int(after["cancelled"] - before["cancelled"]),
        "kv_pages_held_before": int(before["kv_pages_held"]),
        "kv_pages_held_after": int(after["kv_pages_held"]),
        "kv_pages_used_before": int(before["kv_pages_used"]),
        "kv_pages_used_after": int(after["kv_pages_used"]),
        "kv_pages_cached_before": int(before["kv_pages_cached"]),
        "kv_pages_cached_after": int(after["kv_pages_cached"]),
        "idle_after_seconds": round(idle_seconds, 3),
        "kv_page_kib": round(after["kv_page_bytes"] / 1024, 1),
        "kv_cached_growth_mb": round(
            (after["kv_pages_cached"] - before["kv_pages_cached"]) * after["kv_page_bytes"] / 2**20, 1
        ),
        "rss_mb_before": round(rss_before, 1),
        "rss_mb_after": round(rss_after, 1),
        "rounds": rounds,
        "server_alive": alive,
        "server_tracebacks": tracebacks,
        "shutdown_tracebacks": shutdown_tracebacks,
        "startup_seconds": round(ready, 1),
        "wall_seconds": round(wall, 1),
        "requests_per_second": round(len(outcomes) / wall, 2),
        "seed": args.seed,
    }
    checks = {
        "no request lost": not lost,
        "no collateral failure": not collateral,
        "every poisoned request a 4xx": poisoned_4xx == len(poisoned),
        "no 5xx": client_5xx == 0 and server_5xx == 0,
        "idle again": idle_after,
        "KV pages held back to before": after["kv_pages_held"] == before["kv_pages_held"],
        "server alive, no traceback in its log": alive and tracebacks == 0,
    }
    summary["passed"] = all(checks.values())
    print(json.dumps(summary))
    dropped = len(by_role["disconnect"])
    used = f"{summary['kv_pages_used_before']} / {summary['kv_pages_used_after']}"
    cached = f"{summary['kv_pages_cached_before']} / {summary['kv_pages_cached_after']}"
    rows = [
        ("requests (healthy / dropped / poisoned)", f"{len(outcomes)} ({len(healthy)} / {dropped} / {len(poisoned)})"),
        ("lost", len(lost)),
        ("collateral failures", len(collateral)),
        ("poisoned answered 4xx", f"{poisoned_4xx} / {len(poisoned)}"),
        ("5xx (client seen / server counted)", f"{client_5xx} / {server_5xx}"),
        ("cancelled by the server", summary["server_cancelled"]),
        ("KV pages held before / after", f"{summary['kv_pages_held_before']} / {summary['kv_pages_held_after']}"),
        ("KV pages used before / after", f"{used} (prefix cache {cached})"),
        ("server RSS before / after", f"{rss_before:.1f} / {rss_after:.1f} MiB"),
        ("KV the prefix cache added", f"{summary['kv_cached_growth_mb']} MiB ({summary['kv_page_kib']} KiB a page)"),
        *(
            [
                ("RSS after each round", " / ".join(f"{r['rss_mb']:.1f}" for r in rounds) + " MiB"),
                ("prefix-cache pages after each round", " / ".join(str(r["kv_pages_cached"]) for r in rounds)),
            ]
            if len(rounds) > 1
            else []
        ),
        ("wall time", f"{wall:.1f} s ({summary['requests_per_second']} requests/s)"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    for o in (lost + collateral + [o for o in poisoned if not o.ok])[:20]:
        print(f"  #{o.index} {o.kind} stream={o.stream} {o.role} {o.poison or ''}: {o.error}")
    if not args.log:
        if summary["passed"]:
            os.unlink(log_path)
        else:
            print(f"the server's log: {log_path}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
