#!/usr/bin/env python3
"""Load an OpenAI-compatible server with concurrent streaming requests.

Standard library only, so the same client measures any server the same way.
Each request streams /v1/completions (a prompt of token ids, so no tokenizer
or chat template is involved) or /v1/chat/completions (--chat).  Prints one
JSON line: requests, failures, aggregate output tokens/s, and time to first
token / inter-token latency percentiles in milliseconds.

    python load_openai.py --url http://127.0.0.1:8080 -c 16 -n 64 \
        --prompt-tokens 128 --max-tokens 128
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import statistics
import threading
import time
from urllib.parse import urlparse


def one_request(args, seed: int) -> dict:
    rng = random.Random(seed)
    u = urlparse(args.url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=args.timeout)
    body = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if args.chat:
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(args.prompt_tokens))
        body["messages"] = [{"role": "user", "content": words}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = [rng.randrange(300, args.vocab) for _ in range(args.prompt_tokens)]
        path = "/v1/completions"
    headers = {"content-type": "application/json"}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    t0 = time.perf_counter()
    stamps, usage = [], None
    try:
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return {"ok": False, "status": resp.status, "error": resp.read(300).decode(errors="replace")}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    stamps.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, not fatal)
        return {"ok": False, "error": repr(exc)}
    finally:
        conn.close()
    tokens = (usage or {}).get("completion_tokens") or len(stamps)
    return {
        "ok": bool(stamps),
        "tokens": tokens,
        "start": t0,
        "ttft": (stamps[0] - t0) if stamps else None,
        "itl": [b - a for a, b in itertools.pairwise(stamps)],
        "end": stamps[-1] if stamps else t0,
    }


def pct(xs, p):
    return round(1000 * xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 2) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="bench")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("-n", "--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--seed", type=int, default=0, help="request i's prompt is drawn from seed + i")
    ap.add_argument("--api-key")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()

    results, lock, next_id = [], threading.Lock(), iter(range(args.requests))

    def worker():
        while True:
            with lock:
                i = next(next_id, None)
            if i is None:
                return
            r = one_request(args, args.seed + i)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    ttft = sorted(r["ttft"] for r in ok)
    itl = sorted(x for r in ok for x in r["itl"])
    print(
        json.dumps(
            {
                "requests": len(results),
                "failed": len(results) - len(ok),
                "concurrency": args.concurrency,
                "wall_s": round(wall, 3),
                "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
                "ttft_ms_p50": pct(ttft, 50),
                "ttft_ms_p99": pct(ttft, 99),
                "itl_ms_p50": pct(itl, 50),
                "itl_ms_p99": pct(itl, 99),
                "itl_ms_mean": round(1000 * statistics.fmean(itl), 2) if itl else None,
                "first_error": next((r.get("error") or r.get("status") for r in results if not r["ok"]), None),
            }
        )
    )


if __name__ == "__main__":
    main()
