"""Qwen3.5 through leat's conformance kit, its recurrent state (chunks, batches, what cannot continue), the gated
delta-net against a float64 loop written here, what it refuses, and the plugin as the CLI sees it. Agreement with
llama.cpp is test_llamacpp_agreement.py's."""

from typing import Any, ClassVar

import gguf
import numpy as np
import pytest
from leat.backend import Backend, KVLayout
from leat.batch import Batch, Row
from leat.conformance import ArchitectureConformance
from leat.deltanet import DeltaNet
from leat.engine import Engine
from leat.errors import BackendUnavailable, LeatError
from leat.model import Model
from leat.modelfile import ModelFile
from leat.testing import assert_generate_is_greedy, assert_plugin_provides, write_tiny_gguf
from leat_arch_qwen35.qwen35 import Qwen35, Qwen35Moe, imrope_factors
from leat_backend_cpu.backend import CPUBackend

# the kit's metadata round trip and chunked-and-batched check run on each (each slot's recurrent state continues
# across chunks and decode steps, apart from the other slots')
VARIANTS: dict[str, dict[str, Any]] = {
    "interval": {},
    "listed": {"layers": 5, "recurrent_layers": (True, False, True, True, False), "k_heads": 4, "tied": False},
    "mtp": {"layers": 5, "nextn_layers": 1},  # a multi-token-prediction layer after the four a forward pass runs
}
PLUGINS = "leat-backend-cpu,leat-arch-qwen35,leat-samplers"


class TestQwen35Conformance(ArchitectureConformance):
    capabilities: ClassVar[frozenset[str]] = frozenset({"embeddings"})
    variants: ClassVar[dict[str, dict[str, Any]]] = VARIANTS

    @pytest.fixture
    def architecture(self):
        return Qwen35


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(Qwen35, tmp_path_factory.mktemp("qwen35") / "qwen35.gguf")


def test_layer_kinds_and_the_kv_cache_of_the_full_layers():
    p = Qwen35.tiny()
    assert [p.linear(i) for i in range(4)] == [True, True, True, False]
    assert len(Qwen35.kv_layouts(p)) == 1
    listed = Qwen35.tiny(**VARIANTS["listed"])
    assert [(x.kv_heads, x.head_dim) for x in Qwen35.kv_layouts(listed)] == [(2, 32)] * 2


def test_imrope_leaves_the_extra_sections_pairs_unrotated():
    """As ggml_mrope_cache_init: pair i's section is i % sum(sections), interleaved t, h, w while each lasts."""
    assert imrope_factors(64, (11, 11, 10, 0)) is None  # Qwen3.5's: every one of the 32 pairs rotates
    assert imrope_factors(16, (2, 2, 1, 0)) is None  # sectors 0..4 of 5: t h w t h, then again
    factors = imrope_factors(16, (2, 2, 1, 1))  # sector 5 of 6: w's one pair is taken, so the extra section's
    assert factors is not None and list(np.flatnonzero(factors > 1)) == [5]
    factors = imrope_factors(16, (1, 1, 1, 1))  # sector 3 of each 4 is the extra section's
    assert factors is not None and list(np.flatnonzero(factors > 1)) == [3, 7]


def reference_delta_net(net, mixed, alpha, beta):
    """The gated delta-net token by token and head by head in float64, from the formulas of leat.deltanet's
    docstring (llama.cpp's ggml_ssm_conv and ggml_gated_delta_net)."""
    t, d, kd = len(mixed), net.head_dim, net.k_heads * net.head_dim
    padded = np.concatenate([np.zeros((net.kernel - 1, mixed.shape[1])), mixed])
    out = np.zeros((t, net.v_heads, d))
    for h in range(net.v_heads):
        kh, state = h % net.k_heads, np.zeros((d, d))
        for i in range(t):
            x = np.array([padded[i : i + net.kernel, c] @ net.conv[c] for c in range(mixed.shape[1])])
            x = x / (1 + np.exp(-x))
            q, k, v = x[kh * d : (kh + 1) * d], x[kd + kh * d : kd + (kh + 1) * d], x[2 * kd + h * d :][:d]
            q = q / np.sqrt(q @ q + net.eps) / np.sqrt(d)
            k = k / np.sqrt(k @ k + net.eps)
            state = state * np.exp(np.log1p(np.exp(alpha[i, h] + net.dt_bias[h])) * net.a[h])
            state = state + np.outer((v - state @ k) / (1 + np.exp(-beta[i, h])), k)
            out[i, h] = state @ q
    return out


@pytest.mark.parametrize("precision", ["f64", "f32"])
def test_gated_delta_net_matches_a_float64_loop_across_steps(precision):
    rng = np.random.default_rng(3)
    net = DeltaNet(
        2, 4, 8, rng.standard_normal((2 * 16 + 32, 4)), rng.standard_normal(4), -np.exp(rng.standard_normal(4)), 1e-6
    )
    mixed, alpha, beta = rng.standard_normal((9, 64)), rng.standard_normal((9, 4)), rng.standard_normal((9, 4))
    want = reference_delta_net(net, mixed, alpha, beta)
    backend = CPUBackend(precision)
    kv = backend.allocate_kv([KVLayout(1, 8)], 2, 16)  # the state is kept beside it, for its 2 slots
    got = []
    for start, stop in [(0, 5), (5, 6), (6, 9)]:  # a prefill chunk, a decode step, another chunk: the state carries
        rows = [Row(1, start, np.zeros(stop - start, np.int64))]
        got.append(
            backend.gated_delta_net(mixed[start:stop], alpha[start:stop], beta[start:stop], net, kv, 0, Batch(rows))
        )
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-4 if precision == "f32" else 1e-10, atol=1e-5)
    restart = backend.gated_delta_net(
        mixed[:2], alpha[:2], beta[:2], net, kv, 0, Batch([Row(1, 0, np.zeros(2, np.int64))])
    )
    np.testing.assert_allclose(restart, want[:2], rtol=1e-4, atol=1e-5)  # position 0: a new sequence, from zeros
    with pytest.raises(LeatError, match="holds the state after 2 positions.*cannot continue at position 5"):
        backend.gated_delta_net(
            mixed[5:6], alpha[5:6], beta[5:6], net, kv, 0, Batch([Row(1, 5, np.zeros(1, np.int64))])
        )


def test_a_row_inside_a_verified_draft_rewinds_to_the_tokens_kept():
    """A row that wanted every position's logits (a verified draft) of 4 tokens, then a row starting after its
    second: the state continues from the first two tokens (as one pass over the kept tokens, then the new ones). A
    plain row of several tokens (a prompt chunk) is not rewound into."""
    rng = np.random.default_rng(4)
    net = DeltaNet(
        2, 4, 8, rng.standard_normal((2 * 16 + 32, 4)), rng.standard_normal(4), -np.exp(rng.standard_normal(4)), 1e-6
    )
    mixed, alpha, beta = rng.standard_normal((12, 64)), rng.standard_normal((12, 4)), rng.standard_normal((12, 4))
    kept = np.r_[0:5, 8:12]  # positions 0-4, then 5-7 rejected, then the row from 5 again with new inputs
    want = reference_delta_net(net, mixed[kept], alpha[kept], beta[kept])
    backend = CPUBackend("f64")
    kv = backend.allocate_kv([KVLayout(1, 8)], 1, 16)

    def step(rows, start, **row):
        inputs = (x[rows] for x in (mixed, alpha, beta))
        return backend.gated_delta_net(*inputs, net, kv, 0, Batch([Row(0, start, np.zeros(len(rows)), **row)]))

    step(np.r_[0:3], 0)
    step(np.r_[3:8], 3, all_logits=True)  # a token and its 4-token draft, of which 2 are kept (positions 3, 4)
    got = step(np.r_[8:12], 5)
    np.testing.assert_allclose(got, want[5:], rtol=1e-10, atol=1e-12)
    with pytest.raises(LeatError, match="holds the state after 9 positions.*cannot continue at position 7"):
        step(np.r_[8:9], 7)  # inside a plain row


def test_a_backend_without_a_recurrent_state_is_refused_before_loading(tiny):
    class Stateless(CPUBackend):
        name = "stateless"
        recurrent_state = Backend.recurrent_state

    with pytest.raises(BackendUnavailable, match="recurrent state per sequence, which the stateless backend"):
        Qwen35(ModelFile(tiny), Stateless("f32"))


def test_the_engine_reuses_no_prefix_and_refuses_sessions(tiny):
    from leat.engine import GenerationRequest

    file, backend = ModelFile(tiny), CPUBackend("f32")
    model = Model(file, Qwen35(file, backend), backend)
    engine = Engine(model, batch_size=2, max_context=64)
    with pytest.raises(LeatError, match="sessions do not keep"):
        engine.submit(GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=2, session="s"))
    assert engine._prefix_keys(None, list(range(40))) == []


class TestQwen35MoeConformance(ArchitectureConformance):
    qtypes: ClassVar[tuple[str, ...]] = ("F32",)

    @pytest.fixture
    def architecture(self):
        return Qwen35Moe


def test_the_engine_continues_each_slots_state_and_resets_it_for_the_next_request(tiny):
    """Greedy requests through two slots, prefilled in chunks of 8 beside the other slot's decode steps, then two more
    once those finished, one of them sharing a 24-token prefix with an earlier one (whose cached pages the engine
    would reuse for another model, continuing a state that is not there). Each continuation is the one the oracle
    gives decoding the request alone."""
    from leat.engine import GenerationRequest

    file, backend = ModelFile(tiny), CPUBackend("f64")
    model = Model(file, Qwen35(file, backend), backend)
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 300, 24).tolist()
    waves = [
        [shared + [5, 6], rng.integers(0, 300, 19).tolist(), [3]],
        [shared + [7], rng.integers(0, 300, 30).tolist()],
    ]
    engine = Engine(model, batch_size=2, max_context=64, page_size=8, prefill_chunk=8)
    engine.start()
    try:
        for prompts in waves:
            handles = [engine.submit(GenerationRequest(p, 5, {"temperature": 0}, ignore_eos=True)) for p in prompts]
            for prompt, events in zip(prompts, [list(handle) for handle in handles]):
                assert events[-1].finish_reason == "length" and events[-1].usage["cached_tokens"] == 0, events[-1]
                ids = list(prompt)
                for _ in range(5):
                    ids.append(int(np.argmax(model.logits(np.array(ids), native=True)[-1])))
                assert [t for event in events for t in event.ids] == ids[len(prompt) :]
    finally:
        engine.stop()


def test_leat_plugins_lists_qwen35():
    assert_plugin_provides("leat-arch-qwen35", "architectures", ["qwen35", "qwen35moe"], plugins=PLUGINS)


def test_cli_generate_is_the_oracles_greedy_continuation(tmp_path):
    """Through the engine: prefill, then decode steps continuing each layer's state."""
    path = write_tiny_gguf(Qwen35, tmp_path / "qwen35.gguf", gguf.GGMLQuantizationType.Q8_0, seed=1)
    file, backend = ModelFile(path), CPUBackend("f64")
    model = Model(file, Qwen35(file, backend), backend)
    assert_generate_is_greedy(path, lambda ids: model.logits(ids, native=True), plugins=PLUGINS)
