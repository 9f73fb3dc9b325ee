"""The tinygrad backend's kernels compiled for AMD GPUs, on a machine without one.

``amd_kernels.py`` (beside this file) runs a tiny Llama-3 Q4_K model's prefill and decode step through the backend on
tinygrad's NULL device and compiles every kernel they use for an RDNA3 (gfx1100) and a CDNA3 (gfx942) target, as
``DEV=AMD:LLVM`` would: tinygrad's LLVM IR renderer and libLLVM's AMDGPU target (LLVM >= 18; `.ci/run` installs
Debian's libllvm19). Each code object is checked as tinygrad's AMD device reads it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REFERENCES = HERE.parents[2] / "tests" / "references"
ARCHS = ["gfx1100", "gfx942"]


def amdgpu_llvm_reason() -> str | None:
    """Why tinygrad's LLVM compiler cannot emit AMD code objects here, or None."""
    import ctypes

    from tinygrad.runtime.autogen import llvm
    from tinygrad.runtime.support.c import DLL

    install = "apt-get install libllvm19 (LLVM 18 or newer, with the AMDGPU target; .ci/run installs it)"
    if llvm.dll.nm not in DLL._loaded_:
        return f"tinygrad finds no libLLVM ({llvm.dll.emsg}): {install}"
    found, (major, minor, patch) = llvm.dll._name, (ctypes.c_uint32() for _ in range(3))
    try:
        llvm.LLVMGetVersion(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
        llvm.LLVMInitializeAMDGPUTargetInfo()
    except AttributeError as missing:  # LLVMGetVersion is LLVM 16's; a build without AMDGPU lacks its initializers
        return f"tinygrad's libLLVM ({found}) is too old or has no AMDGPU target ({missing}): {install}"
    if major.value < 18:
        return f"tinygrad's libLLVM ({found}) is LLVM {major.value}; its AMDGPU IR needs 18 or newer: {install}"
    return None


@pytest.mark.slow
def test_every_kernel_of_a_prefill_and_a_decode_step_compiles_for_rdna3_and_cdna3(tmp_path):
    if (reason := amdgpu_llvm_reason()) is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must compile the AMD kernels: {reason}")
        pytest.skip(reason)
    spec = importlib.util.spec_from_file_location("tiny_models", REFERENCES / "tiny_models.py")
    tiny_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_models)
    model = tiny_models.build("q4_k-llama3", tmp_path / "tiny.gguf")
    env = os.environ | {
        "DEV": f"NULL:AMDLLVM:{ARCHS[0]}",
        "NULL_ALLOW_COPYOUT": "1",
        "NOOPT": "1",
        "CACHELEVEL": "0",
        "CACHEDB": str(tmp_path / "cache.db"),
        "LEAT_TINYGRAD_PREFILL_JIT": "16",
        "LEAT_TINYGRAD_HALF": "1",  # float16 prefill products, as on a GPU (the suite's other tests hold float32)
    }
    command = [sys.executable, str(HERE / "amd_kernels.py"), str(model), *ARCHS]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.splitlines()[-1])
    print(report)
    # the prefill's eager and jitted chunk and the decode step: products (split and dequantize-then-multiply), norms,
    # rope, KV writes, paged attention; each kernel once per target
    assert report["kernels"] >= 40 and all(report[arch]["kernels"] == report["kernels"] for arch in ARCHS), report
    # the chunks' softmax (softmax.py): the eager chunk's, the jitted full chunk's and the padded last chunk's
    assert report["softmax"], report
    # the decode step's attention (attention.py): the scores and chunks in one kernel (local memory), then the combine
    assert any(n.startswith("attn_fused_") for n in report["attention"]), report
    assert any(n.startswith("attn_combine_") and not n.endswith("_lanes") for n in report["attention"]), report
    assert any(n.endswith("_lanes") for n in report["attention"]), report
    # gemv.py's quantized products of every type (amd_kernels.run_gemv: two rows), and the model's own (one row)
    import gguf
    from leat_backend_tinygrad.gemv import LAYOUTS

    names = {f"gemv_{q.name.lower()}_2_64_{512 // gguf.GGML_QUANT_SIZES[q][0]}" for q in LAYOUTS}
    assert names <= set(report["gemv"]) and any(name.startswith("gemv_q4_k_1_") for name in report["gemv"]), report
    # and on 16-bit integer x (intx.py; LEAT_TINYGRAD_INT_PRODUCTS=1): the norm that quantizes, q/k/v with RoPE (the
    # tiny model's v is Q4_K too), the gated unit, quantize_x and the residual products
    integer = report["integer"]
    assert any(n.startswith("rms_norm_") for n in integer) and any(n.startswith("quantize_x_") for n in integer)
    for kind in ("_i16_rope", "_i16_glu", "_i16_residual"):
        assert any(n.endswith(kind) for n in integer), (kind, integer)
    from leat_backend_tinygrad import intx  # each integer type's product (amd_kernels.run_gemv)

    assert {f"gemv_{q.name.lower()}_2_64_2_i16" for q in intx.DOTS} <= set(integer), integer
