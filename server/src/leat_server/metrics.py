"""Prometheus metrics for ``GET /metrics``: HTTP requests, tokens, latencies, and the engine's queue and KV pages."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class EngineCollector:
    """Reads ``engine.stats()`` at scrape time."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        gauges = {
            "queue_depth": "requests waiting for a slot",
            "running": "requests being decoded",
            "kv_pages_used": "KV cache pages in use",
            "kv_pages_free": "KV cache pages free",
            "kv_pages_total": "KV cache pages in all",
            "kv_pages_cached": "KV cache pages held for prefix reuse",
        }
        for key, help_text in gauges.items():
            if key in stats:
                yield GaugeMetricFamily(f"leat_{key}", help_text, value=float(stats[key]))
        allocations = GaugeMetricFamily("leat_allocated_bytes", "bytes the backend holds, by purpose", labels=["kind"])
        for kind, value in (stats.get("allocations") or {}).items():
            allocations.add_metric([kind], float(value))
        yield allocations
        counters = {
            "steps": ("leat_engine_steps", "forward passes the scheduler ran"),
            "prefill_steps": ("leat_engine_prefill_steps", "forward passes that carried a prompt chunk"),
            "steps_ahead": ("leat_engine_steps_ahead", "decode steps queued before the last one's tokens were read"),
            "busy_seconds": ("leat_engine_busy_seconds", "seconds the scheduler spent in steps"),
        }
        for key, (name, help_text) in counters.items():
            if key in stats:
                yield CounterMetricFamily(name, help_text, value=float(stats[key]))


class Metrics:
    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http = Counter("leat_http_requests", "HTTP requests by path and status", ["path", "status"], registry=r)
        self.requests = Counter("leat_requests", "generation requests by endpoint", ["endpoint"], registry=r)
        self.finishes = Counter(
            "leat_requests_finished",
            "generations by endpoint and finish reason",
            ["endpoint", "finish_reason"],
            registry=r,
        )
        self.cancels = Counter(
            "leat_requests_cancelled", "generations whose client went away", ["endpoint"], registry=r
        )
        self.prompt_tokens = Counter("leat_prompt_tokens", "prompt tokens submitted", registry=r)
        self.generated_tokens = Counter("leat_generated_tokens", "tokens generated", registry=r)
        self.latency = Histogram(
            "leat_request_duration_seconds",
            "time from submit to the last token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "leat_time_to_first_token_seconds",
            "time from submit to the first token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            "leat_time_per_output_token_seconds",
            "decode time per generated token",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        r.register(EngineCollector(engine))

    def submitted(self, endpoint: str, prompt_tokens: int) -> None:
        self.requests.labels(endpoint).inc()
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint).observe(seconds)

    def cancelled(self, endpoint: str) -> None:
        self.cancels.labels(endpoint).inc()

    def finished(self, endpoint: str, result: Any, seconds: float) -> None:
        self.finishes.labels(endpoint, result.finish_reason).inc()
        self.generated_tokens.inc(result.completion_tokens)
        self.latency.labels(endpoint).observe(seconds)
        ttft = result.timings.get("ttft_seconds")
        total = result.timings.get("total_seconds")
        if ttft is not None and total is not None and result.completion_tokens > 1:
            self.per_token.observe(max(0.0, total - ttft) / (result.completion_tokens - 1))

    def http_request(self, path: str, status: int) -> None:
        self.http.labels(path, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
