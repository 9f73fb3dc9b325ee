"""The request router of the replica deployment (Ray Serve's request router API): prefix or session affinity
(:mod:`leat_ray.routing`), falling back to the least loaded replica."""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from leat_ray.routing import IMBALANCE, ProxiedRequest, preferred


class PrefixAffinityRouter(RequestRouter):
    """Sends a request with a key to its preferred replica while that one is within ``imbalance`` requests of
    the least loaded; everything else to the least loaded (Serve picks the lowest queue among the candidates)."""

    def initialize_state(self, imbalance: int = IMBALANCE, **_: object) -> None:
        if not isinstance(imbalance, int) or imbalance < 0:
            raise ValueError(f"request_router_kwargs.imbalance must be a whole number >= 0, not {imbalance!r}")
        self.imbalance = imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = _key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [_shuffled(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        chosen = by_id[preferred(key, list(by_id))]
        if await self._within_imbalance(chosen, candidate_replicas):
            return [[chosen], _shuffled(candidate_replicas)]  # the second rank: when the preferred one is full
        return [_shuffled(candidate_replicas)]

    async def _within_imbalance(self, chosen: RunningReplica, candidates: list[RunningReplica]) -> bool:
        lengths = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) for r in candidates}
        missing = [r for r in candidates if lengths[r.replica_id] is None]
        if missing:
            for replica, length in await self._probe_queue_lens(missing, 0):
                lengths[replica.replica_id] = length
        known = [n for n in lengths.values() if n is not None]
        mine = lengths[chosen.replica_id]
        return mine is not None and mine - min(known) <= self.imbalance


def _shuffled(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """In random order: Serve takes the first of equally loaded replicas, so idle ones share the work."""
    return random.sample(replicas, len(replicas))


def _key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, ProxiedRequest):
            return arg.key
    return None
