"""What the cross-plugin tests share: SmolLM2 under the float64 oracle, and its logits for the prompts recorded with
the llama.cpp references, computed once per session (the agreement with llama.cpp and the float32 path's
agreement with the oracle both compare against them; computing them is most of either test's time)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REFERENCES = Path(__file__).parent / "references"


@pytest.fixture(scope="session")
def smollm2_f64():
    import leat
    from leat.errors import PullError

    try:
        return leat.load("default", backend="cpu", precision="f64")
    except PullError as error:  # offline and not cached
        pytest.skip(f"SmolLM2 is not cached and could not be pulled: {error}")


@pytest.fixture(scope="session")
def smollm2_oracle(smollm2_f64) -> dict[str, tuple[list[int], np.ndarray]]:
    """Each recorded prompt's key -> (its token ids, the f64 oracle's logits at every position)."""
    prompts = json.loads((REFERENCES / "llamacpp.json").read_text())["smollm2"]["prompts"]
    out = {}
    with np.load(REFERENCES / "llamacpp_smollm2.npz") as data:
        for prompt in prompts:
            ids = [int(t) for t in data[f"{prompt['key']}/tokens"]]
            out[prompt["key"]] = (ids, smollm2_f64.logits(ids, native=True))
    return out
