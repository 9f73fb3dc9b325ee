"""The gated delta-net kernels (kernels/deltanet.cu: deltanet_conv, deltanet_recur, sigmoid_mul) compiled for the host
with g++ and run with each CUDA thread a fiber (test_moe_mla_on_host.py's harness), launched as deltanet.py launches
them, against leat.deltanet.run in float64: two sequences in two slots through a prefill batch with a padding token
and then decode steps in the other order, each slot's state continuing apart from the other's; a row at position 0
starts from zeros whatever its slot held; a padding token's outputs are zeros; and the tiny qwen35's delta-net layers
on the inputs the float64 oracle gives them over a 200-token prompt, whole and as 48-token chunks beside another
slot's decode steps. No GPU needed; skipped where g++ is missing."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from leat.deltanet import DeltaNet, run

_spec = importlib.util.spec_from_file_location("moe_mla_on_host", Path(__file__).parent / "test_moe_mla_on_host.py")
host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host)
ptr, f32 = host.ptr, host.f32

HARNESS = r"""
extern "C" void conv4(const float* mixed, const float* conv, const int* slot, const int* pos, float* tails, float* x,
                      int n, int channels) {
    launch({(unsigned)((channels + 127) / 128), (unsigned)n, 1}, 128,
           [=] { deltanet_conv<4>(mixed, conv, slot, pos, tails, x, n, channels); });
}
#define RECUR(D)                                                                                                  \
    extern "C" void recur##D(const float* x, const float* alpha, const float* beta, const float* dt_bias,        \
                             const float* a, const int* slot, const int* pos, float* states, float* out, int n,   \
                             int k_heads, int v_heads, float eps) {                                               \
        launch({(unsigned)n, (unsigned)v_heads, (unsigned)((D + 31) / 32)}, 32, [=] {                            \
            deltanet_recur<D>(x, alpha, beta, dt_bias, a, slot, pos, states, out, n, k_heads, v_heads, eps);      \
        });                                                                                                       \
    }
RECUR(8)
RECUR(16)
RECUR(64)
extern "C" void gate(const float* g, const float* x, float* y, long long n, int cols, int gate_cols) {
    launch({2, 1, 1}, 64, [=] { sigmoid_mul(g, x, y, n, cols, gate_cols); });
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return host.host_library(tmp_path_factory, "deltanet-host", host._kernel("deltanet.cu") + HARNESS)


def step(kernels, net, mixed, alpha, beta, slots, positions, tails, states):
    """One step's tokens (their slots and positions; slot -1: padding) through both kernels, as deltanet.py does."""
    n, channels, d = len(mixed), net.conv.shape[0], net.head_dim
    x, out = np.full((n, channels), np.nan, np.float32), np.full((n, net.v_heads, d), np.nan, np.float32)
    slot, pos = np.asarray(slots, np.int32), np.asarray(positions, np.int32)
    # kept in names until the calls return (a pointer to a temporary outlives its array)
    mixed, alpha, beta, conv, dt_bias, a = (f32(v) for v in (mixed, alpha, beta, net.conv, net.dt_bias, net.a))
    kernels.conv4(ptr(mixed), ptr(conv), ptr(slot), ptr(pos), ptr(tails), ptr(x), n, channels)
    recur = getattr(kernels, f"recur{d}")
    args = [ptr(x), ptr(alpha), ptr(beta), ptr(dt_bias), ptr(a), ptr(slot), ptr(pos), ptr(states)]
    recur(*args, ptr(out), n, net.k_heads, net.v_heads, host.ctypes.c_float(net.eps))
    return out


def sequences(k_heads, v_heads, d, lengths):
    """A random delta-net layer (convolution over 4 tokens), random inputs of a sequence per slot of ``lengths``
    (slot -> tokens) and the outputs leat.deltanet.run gives for each whole, in float64 (test_gpu_qwen35.py's too)."""
    rng = np.random.default_rng(d)
    channels = (2 * k_heads + v_heads) * d
    net = DeltaNet(
        k_heads, v_heads, d, rng.standard_normal((channels, 4)) * 0.5, rng.standard_normal(v_heads),
        -np.exp(rng.standard_normal(v_heads)), 1e-6,
    )  # fmt: skip
    inputs = {s: [rng.standard_normal((t, w)) for w in (channels, v_heads, v_heads)] for s, t in lengths.items()}
    want = {s: run(net, *inputs[s], np.zeros((3, channels)), np.zeros((v_heads, d, d))) for s in lengths}
    return net, inputs, want


@pytest.mark.parametrize("k_heads, v_heads, d", [(2, 4, 8), (1, 2, 64)])
def test_two_slots_prefill_with_padding_then_decode_steps(kernels, k_heads, v_heads, d):
    # slot -> tokens: a prefill of 5 and 2, then two decode steps each
    net, inputs, want = sequences(k_heads, v_heads, d, {0: 7, 1: 4})
    channels, rng = net.conv.shape[0], np.random.default_rng(0)
    # stale values in both slots: a row at position 0 must not read them
    tails = f32(rng.standard_normal((2, 3, channels)))
    states = f32(rng.standard_normal((2, v_heads, d, d)))
    steps = [[(0, 0, 5), (1, 0, 2), (-1, 0, 1)], [(1, 2, 1), (0, 5, 1)], [(0, 6, 1), (1, 3, 1)]]
    for rows in steps:
        picked = [[inputs[max(s, 0)][i][p : p + t] for i in range(3)] for s, p, t in rows]
        slots = np.concatenate([np.full(t, s) for s, _, t in rows])
        positions = np.concatenate([np.arange(p, p + t) for _, p, t in rows])
        got = step(
            kernels, net, *(np.concatenate([x[i] for x in picked]) for i in range(3)), slots, positions, tails, states
        )
        at = 0
        for s, p, t in rows:
            expected = want[s][p : p + t] if s >= 0 else np.zeros((t, v_heads, d))
            np.testing.assert_allclose(got[at : at + t], expected, rtol=2e-4, atol=2e-5)
            at += t


def oracle_layers(tmp_path):
    """The tiny qwen35's linear layers over a 200-token prompt in the float64 oracle: per layer its DeltaNet, the
    inputs gated_delta_net got (mixed, alpha, beta) and what it returned."""
    qwen35 = pytest.importorskip("leat_arch_qwen35.qwen35")
    from leat.batch import Batch, Row
    from leat.modelfile import ModelFile
    from leat.testing import write_tiny_gguf
    from leat_backend_cpu.backend import CPUBackend

    backend, seen = CPUBackend("f64"), {}
    model = qwen35.Qwen35(ModelFile(write_tiny_gguf(qwen35.Qwen35, tmp_path / "qwen35.gguf")), backend)
    original = backend.gated_delta_net

    def recorded(mixed, alpha, beta, net, kv, layer, batch):
        seen[layer] = (net, mixed, alpha, beta, original(mixed, alpha, beta, net, kv, layer, batch))
        return seen[layer][-1]

    backend.gated_delta_net = recorded
    tokens = np.random.default_rng(0).integers(0, model.params.vocab, 200)
    model.forward(Batch([Row(0, 0, tokens)]), backend.allocate_kv(model.kv_layouts(model.params), 1, 200))
    return seen


def test_tiny_qwen35_layers_on_their_oracle_inputs(kernels, tmp_path):
    """Each step from NaN states: the prompt whole in slot 0; then in chunks of 48 in slot 1 beside a decode row of
    slot 0 (the same sequence again) and two padding tokens. Every token's outputs within 1e-4 of the oracle's
    relative to the token's largest (float32 gives ~1e-6)."""
    for layer, (net, mixed, alpha, beta, want) in oracle_layers(tmp_path).items():
        channels, v, d = net.conv.shape[0], net.v_heads, net.head_dim
        tails, states = f32(np.full((2, 3, channels), np.nan)), f32(np.full((2, v, d, d), np.nan))
        whole = step(kernels, net, mixed, alpha, beta, np.zeros(200), np.arange(200), tails, states)
        chunks, decoded = [], []
        for start in range(0, 200, 48):
            rows = [(0, start // 48, 1), (1, start, min(48, 200 - start)), (-1, 0, 2)]
            inputs = [np.concatenate([x[p : p + t] if s >= 0 else np.zeros((t, x.shape[1])) for s, p, t in rows])
                      for x in (mixed, alpha, beta)]  # fmt: skip
            slots = np.concatenate([np.full(t, s) for s, _, t in rows])
            positions = np.concatenate([np.arange(p, p + t) for _, p, t in rows])
            out = step(kernels, net, *inputs, slots, positions, tails, states)
            decoded.append(out[0])
            chunks.append(out[1 : 1 + rows[1][2]])
            assert not out[1 + rows[1][2] :].any()
        for got, expected in ((whole, want), (np.concatenate(chunks), want), (np.stack(decoded), want[:5])):
            error = np.abs(got - expected).reshape(len(got), -1).max(1)
            assert np.all(error <= 1e-4 * np.abs(expected).reshape(len(got), -1).max(1)), (layer, error.max())


def test_sigmoid_mul_by_element_and_by_row(kernels):
    rng = np.random.default_rng(1)
    x = f32(rng.standard_normal((5, 24)) * 3)
    for gate in (f32(rng.standard_normal((5, 24)) * 4), f32(rng.standard_normal((5, 1)) * 4)):
        y = np.zeros_like(x)
        kernels.gate(ptr(gate), ptr(x), ptr(y), x.size, x.shape[1], gate.shape[1])
        want = x.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64)))
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
