"""The example backend through leat's conformance kit: the checks every backend plugin passes, and one more of the
paged cache the engine relies on (sliding windows, pages out of order, a copied page, pages moved)."""

import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.conformance import BackendConformance

pytest.importorskip("leat_backend_example", reason="tested once installed: tests/test_template_plugin.py")


class TestExampleBackendConformance(BackendConformance):
    capabilities = frozenset({"windows", "softcap", "sinks"})

    @pytest.fixture
    def backend(self):
        from leat_backend_example.backend import ExampleBackend

        return ExampleBackend("f32")

    def test_windowed_attention_on_moved_pages(self, backend):
        heads, kv_heads, dim, window, scale = 4, 2, 8, 10, 0.3
        q, k, v = self.inputs((12, heads, dim), (12, kv_heads, dim), (12, kv_heads, dim), seed=7)
        kv = backend.allocate_kv([KVLayout(kv_heads, dim, window=window)], slots=2, context=16, pages=8, page_size=4)

        def attend(slot, start, n):
            batch = Batch([Row(slot, start, np.zeros(n, np.int64), all_logits=True)])
            tensors = (self.to_device(backend, t[start : start + n]) for t in (q, k, v))
            out = backend.to_host(backend.attention(*tensors, kv, 0, batch, scale))
            want = windowed_attention(q[start : start + n], k[: start + n], v[: start + n], start, scale, window)
            tol = self.tolerance[backend.precision]
            np.testing.assert_allclose(np.asarray(out, np.float64).reshape(want.shape), want, rtol=tol, atol=tol)

        backend.set_pages(kv, 0, np.array([5, 2, 7]))
        attend(0, 0, 9)
        # slot 1 continues slot 0's first 8 positions: one page copied, one moved out and back in, one of its own
        backend.copy_page(kv, 5, 0)
        backend.write_pages(kv, [1], backend.read_pages(kv, [2]))
        backend.set_pages(kv, 1, np.array([0, 1, 3]))
        attend(1, 8, 4)


def windowed_attention(q, k, v, start, scale, window):
    """float64 reference: query t (position start + t) attends to positions max(0, p - window + 1) .. p."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    out = np.zeros((n, heads, v.shape[2]))
    for t in range(n):
        keys = slice(max(0, start + t - window + 1), start + t + 1)
        for h in range(heads):
            scores = k[keys, h // group] @ q[t, h] * scale
            p = np.exp(scores - scores.max())
            out[t, h] = p / p.sum() @ v[keys, h // group]
    return out.reshape(n, -1)
