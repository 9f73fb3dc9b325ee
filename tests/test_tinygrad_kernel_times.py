"""scripts/tinygrad_kernel_times.py: the last step's kernels from tinygrad's DEBUG=2 lines, summed by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tinygrad_kernel_times", ROOT / "scripts" / "tinygrad_kernel_times.py")
kernel_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_times)

GREEN, END = "\x1b[32m", "\x1b[0m"
OUTPUT = f"""loading
#step-begin
*** CUDA       10 gemv_q4_k_1_2048_8                             arg  3 mem   1.00 GB tm    999.00us/    1.00ms (  1 GFLOPS  1|1 GB/s)
#step-begin
{GREEN}*** CUDA       11{END} \x1b[33mcopy        4 B,    CUDA <- NPY{END}            arg  2 mem   1.00 GB tm      5.00us/    1.00ms (  0 GFLOPS  0|0 GB/s)
*** CUDA       12 gemv_q4_k_1_2048_8                             arg  3 mem   1.00 GB tm     12.50us/    1.01ms (  1 GFLOPS  1|1 GB/s)
{GREEN}*** CUDA       13{END} r_16_128                                       arg  2 mem   1.00 GB tm      2.25us/    1.02ms (  1 GFLOPS  1|1 GB/s)
*** CUDA       14 gemv_q4_k_1_2048_8                             arg  3 mem   1.00 GB tm \x1b[33m   11.00ms{END}/   12.02ms (  1 GFLOPS  1|1 GB/s)
#step-begin
"""


def test_the_last_step_is_summed_by_kernel_name_without_copies():
    table = kernel_times.kernel_times(OUTPUT)
    assert set(table) == {"gemv_q4_k_1_2048_8", "r_16_128"}  # the first step's line and the copy are left out
    launches, seconds = table["gemv_q4_k_1_2048_8"]
    assert launches == 2 and seconds == pytest.approx(12.5e-6 + 11e-3)
    assert table["r_16_128"] == (1, pytest.approx(2.25e-6))
    report = kernel_times.report(table)
    assert report.splitlines()[0] == "# 3 kernels, 11.015 ms summed"
    assert report.splitlines()[3].startswith("| `gemv_q4_k_1_2048_8` | 2 | 11012.5 |")
