"""The tinygrad backend's tests run its float products unless the run says otherwise.

The backend's default on a CUDA renderer is Q4_K and Q6_K products of 16-bit integer x (``LEAT_TINYGRAD_INT_PRODUCTS``,
intx.py), whose agreement with the float64 oracle is the backend bar (top-1 >= 99%, mean KL < 1e-3), not float32's
~1e-13 that most of these tests hold the float path to. ``test_tinygrad_intx.py`` sets the variable itself and checks
the integer path at its bar; a run with ``LEAT_TINYGRAD_INT_PRODUCTS`` set keeps the value it was given. The variable
is set for each module before its fixtures (a module's ``backend`` is made once: on the H200 one made before a
function's setting took integer x, and a Q6_K product missed the float bar by 2e-4); a test's own ``monkeypatch``
of it is undone after the test.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module", autouse=True)
def _float_products_unless_asked():
    with pytest.MonkeyPatch.context() as patch:
        if "LEAT_TINYGRAD_INT_PRODUCTS" not in os.environ:
            patch.setenv("LEAT_TINYGRAD_INT_PRODUCTS", "0")
        yield


@pytest.fixture(scope="session")
def cpu_device() -> str:
    """tinygrad's CPU device, for a test that checks it beside a device with thread groups; skipped where it cannot
    compile (a GPU machine without clang, where ``CC`` may be a gcc that does not take clang's ``--target``)."""
    from tinygrad import Tensor

    try:
        (Tensor([1.0], device="CPU") + 1).realize().numpy()
    except Exception as error:  # noqa: BLE001 - a compiler's failure can be any error; the skip names it
        pytest.skip(f"tinygrad's CPU device cannot compile here: {str(error)[:200]}")
    return "CPU"
