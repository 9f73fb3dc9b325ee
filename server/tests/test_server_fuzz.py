"""Fuzzing a real ``leat serve`` from its own OpenAPI schema with schemathesis: valid and invalid requests to every
operation, about a minute in all. Whatever a client sends, the answer is never a 5xx."""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from leat.keys import KeyStore
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess

BUDGET = 60.0  # seconds of fuzzing, shared out evenly between operations and generation modes
EXAMPLES = 150  # the most cases per operation and mode


@pytest.fixture(scope="module")
def server(leat_home):
    home = leat_home()
    model = write_tiny_gguf(Llama, home / "tiny.gguf", params=Llama.tiny(context=256))  # short answers: more cases
    store = KeyStore(home / "keys.json")
    key = store.add("fuzz")
    args = ["--backend", "cpu", "--batch-size", "4", "--api-key-file", str(store.path)]
    args += ["--session-store", str(home / "sessions"), "--template-timeout", "2"]
    with ServerProcess(model, args, env={"LEAT_HOME": str(home)}) as proc:
        proc.headers = {"Authorization": f"Bearer {key}"}
        yield proc


class OutOfTime(Exception):
    """Raised by the first case after an operation's share of the budget: it ends hypothesis' run, which would
    otherwise still generate (and not send) the rest of its examples (110-180 s in all on a loaded 2-core machine,
    not the minute that is fuzzed)."""


def fuzz(server, operation, mode, until: float, statuses: Counter, errors: list[str]) -> None:
    """Up to EXAMPLES cases of ``operation`` in generation ``mode``, sent until the clock passes ``until``."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case) -> None:
        if time.monotonic() > until:
            raise OutOfTime
        response = case.call(base_url=server.url, headers=server.headers, timeout=60)
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            errors.append(f"{case.method} {case.formatted_path} {case.body!r:.300} -> {response.text:.300}")

    with contextlib.suppress(Unsatisfiable, OutOfTime):  # Unsatisfiable: nothing to make invalid (no parameters)
        send()


@pytest.mark.slow
def test_no_request_gets_a_server_error(server):
    document = httpx.get(server.url + "/openapi.json", headers=server.headers, timeout=30).json()
    operations = [result.ok() for result in schemathesis.openapi.from_dict(document).get_all_operations()]
    share = BUDGET / (2 * len(operations))
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    for operation in operations:
        for mode in schemathesis.GenerationMode:
            fuzz(server, operation, mode, time.monotonic() + share, statuses, errors)
    cases = sum(statuses.values())
    print(f"\nfuzzed {cases} requests over {len(operations)} operations: {dict(sorted(statuses.items()))}")
    assert server.process.poll() is None, server.output()
    assert cases >= 100
    assert not errors, f"{len(errors)} of {cases} requests got a 5xx:\n" + "\n".join(errors[:10])
