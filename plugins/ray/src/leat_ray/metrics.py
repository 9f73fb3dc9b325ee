"""leat's per-replica Prometheus figures (``leat serve``'s ``/metrics``) as Ray metrics, so that Ray's metrics
endpoint on each node serves them beside Ray's and Serve's own: one place to scrape. Each sample becomes a Ray
gauge of the same name (Prometheus shows it as ``ray_<name>``) with the sample's labels, plus the deployment,
replica and application tags Serve adds; a counter's sample (``..._total``) carries its running total."""

from __future__ import annotations

from typing import Any


class MetricsMirror:
    """Copies ``registry``'s samples into Ray gauges when :meth:`mirror` is called (each health check of the
    replica: every ``health_check_period_s``)."""

    def __init__(self, registry: Any):
        self.registry = registry
        self.gauges: dict[tuple[str, tuple[str, ...]], Any] = {}

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
