"""scripts/kernel_sass.py: the loop it reports is the shortest backward branch around the opcode asked for."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("leat_backend_cuda")
ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kernel_sass", ROOT / "scripts" / "kernel_sass.py")
kernel_sass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_sass)

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   IDP.2A.LO.S16.S8 R8, R4, R5, RZ ;
        /*0030*/                   LOP3.LUT R9, R6, 0xf0f0f0f, RZ, 0xc0, !PT ;
        /*0040*/                   IDP.2A.HI.S16.S8 R8, R9, R5, R8 ;
        /*0050*/              @!P0 BRA 0x20 ;
        /*0060*/                   FADD R10, R8, R10 ;
        /*0070*/                   BRA 0x10 ;
        /*0080*/                   SHFL.BFLY PT, R11, R10, 0x10, 0x1f ;
        /*0090*/              @P1 BRA 0x80 ;
        /*00a0*/                   EXIT ;
"""


def test_the_innermost_loop_around_the_opcode():
    assert kernel_sass.innermost_loop(SASS, "IDP") == ["IDP.2A.LO.S16.S8", "LOP3.LUT", "IDP.2A.HI.S16.S8", "BRA"]
    assert kernel_sass.innermost_loop(SASS, "FADD") == [
        "LDG.E.128",
        *kernel_sass.innermost_loop(SASS, "IDP"),
        "FADD",
        "BRA",
    ]
    assert kernel_sass.innermost_loop(SASS, "HMMA") == []
