"""leat's per-replica Prometheus figures (``leat serve``'s ``/metrics``) as Ray metrics, so that Ray's metrics
endpoint on each node serves them beside Ray's and Serve's own: one place to scrape. Each sample becomes a Ray
gauge of the same name (Prometheus shows it as ``ray_<name>``) with the sample's labels, plus the deployment,
replica and application tags Serve adds; a counter's sample (``..._total``) carries its running total."""

from __future__ import annotations

import logging
import threading
from typing import Any

PERIOD = 5.0  # seconds between two copies; Ray's own export interval is of the same order

log = logging.getLogger("leat_ray")


class MetricsMirror:
    """Copies ``registry``'s samples into Ray gauges every :data:`PERIOD` seconds, on a thread of its own."""

    def __init__(self, registry: Any, period: float = PERIOD, start: bool = True):
        self.registry = registry
        self.period = period
        self.gauges: dict[tuple[str, tuple[str, ...]], Any] = {}
        self.stopped = threading.Event()
        if start:
            threading.Thread(target=self._loop, name="leat-ray-metrics", daemon=True).start()

    def samples(self) -> list[tuple[str, str, dict[str, str], float]]:
        """(name, help, labels, value) of every sample in the registry now."""
        return [
            (sample.name, family.documentation, dict(sample.labels), float(sample.value))
            for family in self.registry.collect()
            for sample in family.samples
            if not sample.name.endswith("_created")  # creation times: not a figure anyone charts
        ]

    def mirror(self) -> None:
        from ray.serve.metrics import Gauge

        for name, help_text, labels, value in self.samples():
            tags = tuple(sorted(labels))
            gauge = self.gauges.get((name, tags))
            if gauge is None:
                gauge = self.gauges[(name, tags)] = Gauge(name, description=help_text or name, tag_keys=tags)
            gauge.set(value, tags=labels or None)

    def _loop(self) -> None:
        while not self.stopped.wait(self.period):
            try:
                self.mirror()
            except Exception:  # logged; the next period tries again
                log.exception("copying leat's metrics into Ray's failed")

    def stop(self) -> None:
        self.stopped.set()
