r"""Compile the tinygrad backend's kernels for AMD GPUs without one: prints a JSON report.

    DEV=NULL:AMDLLVM:gfx1100 NULL_ALLOW_COPYOUT=1 NOOPT=1 CACHELEVEL=0 LEAT_TINYGRAD_PREFILL_JIT=16 \
        python amd_kernels.py MODEL.gguf gfx1100 gfx942 [--kv f16]

tinygrad's NULL device runs nothing (copies out give zeros with NULL_ALLOW_COPYOUT=1) but schedules and compiles
every kernel with the renderer ``DEV`` names: AMDLLVM is ``DEV=AMD:LLVM``'s, LLVM IR compiled to an AMDGPU code
object by libLLVM (LLVM >= 18) in-process. The model's prefill and a decode step (``run_model``) run once with
NOOPT=1, for the kernels' ASTs (tinygrad optimizes a kernel when it lowers it); then each AST is lowered with the
kernel optimizer on, as on a GPU, and compiled for each target in tinygrad's worker pool. Each code object is
checked as ``AMDProgram`` reads it (``check``). CACHELEVEL=0: every kernel is compiled, none comes from the disk cache.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import time
from dataclasses import replace

# EF_AMDGPU_MACH_AMDGCN_* (LLVM's include/llvm/BinaryFormat/ELF.h), the low byte of a code object's e_flags; LLVM 19
# knows no gfx950 (MI350: "not a recognized processor")
MACH = {"gfx1100": 0x041, "gfx1101": 0x046, "gfx1102": 0x047, "gfx1151": 0x04A, "gfx942": 0x04C}
MACH |= {"gfx1200": 0x048, "gfx1201": 0x04E}
EM_AMDGPU, ELFOSABI_AMDGPU_HSA, R_AMDGPU_REL64 = 224, 64, 5
WAVE32 = 0x400  # kernel_code_properties: ENABLE_WAVEFRONT_SIZE32 (RDNA; CDNA runs wave64 only)


def check(lib: bytes, arch: str) -> dict:
    """What tinygrad's AMD device reads from a code object (AMDProgram.__init__), checked: an AMDGPU ELF for ``arch``,
    REL64 relocations only (applied as the device applies them), the kernel descriptor at the start of .rodata, the
    entry it names inside .text, the wavefront size the target runs."""
    from tinygrad.runtime.autogen import amdgpu_kd, libc
    from tinygrad.runtime.support.elf import elf_loader

    header = libc.Elf64_Ehdr.from_buffer_copy(lib)
    assert lib[:4] == b"\x7fELF" and header.e_ident[libc.EI_OSABI] == ELFOSABI_AMDGPU_HSA, lib[:16]
    assert header.e_machine == EM_AMDGPU, header.e_machine
    assert header.e_flags & 0xFF == MACH[arch], f"e_flags {header.e_flags:#x}, {arch} is {MACH[arch]:#x}"
    image, sections, relocs = elf_loader(lib)
    named = {s.name: s.header for s in sections}
    rodata, text = named[".rodata"].sh_addr, named[".text"]
    for at, symbol, kind, addend in relocs:
        assert kind == R_AMDGPU_REL64, relocs
        image[at : at + 8] = struct.pack("<q", symbol - at + addend)
    desc = amdgpu_kd.llvm_amdhsa_kernel_descriptor_t.from_buffer_copy(bytes(image[rodata : rodata + 64]))
    entry = rodata + desc.kernel_code_entry_byte_offset
    assert text.sh_addr <= entry < text.sh_addr + text.sh_size, (entry, text.sh_addr, text.sh_size)
    assert bool(desc.kernel_code_properties & WAVE32) == arch.startswith("gfx1"), desc.kernel_code_properties
    return {"lds": desc.group_segment_fixed_size, "scratch": desc.private_segment_fixed_size, "bytes": len(lib)}


def run_model(path: str, kv_dtype: str) -> None:
    """A prefill chunk (16 tokens: eager, then captured under TinyJit as full chunks are), a decode step, a 5-token
    chunk padded to 16 (both captured under TinyJit) and a mixed step (a decode row and another slot's 5-token chunk)
    through ``Backend.run``, as the engine runs them; then gemv.py's kernels (``run_gemv``); then a chunk and a
    decode step with integer products."""
    import leat
    import numpy as np
    from leat.batch import Batch, Row

    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    layouts = model.architecture.kv_layouts(model.architecture.params)
    kv = backend.allocate_kv(layouts, slots=2, context=48, dtype=kv_dtype)
    backend.set_pages(kv, 0, np.arange(3))
    backend.set_pages(kv, 1, np.arange(3, 6))
    # a full chunk, a decode step, then a shorter chunk (a prompt's last: padded to 16 under TinyJit)
    for row in (Row(0, 0, np.arange(1, 17)), Row(0, 16, np.array([17])), Row(0, 17, np.arange(18, 23))):
        backend.to_host(backend.run(forward, Batch([row]), kv))
    # a prompt joining a decoding request: run as an eager step, then captured (the mixed step's TinyJit)
    for start in (0, 5):
        rows = [Row(0, 22 + start // 5, np.array([23])), Row(1, start, np.arange(30 + start, 35 + start))]
        backend.to_host(backend.run(forward, Batch(rows), kv))
    run_gemv()
    run_attention()
    # the integer products' kernels (LEAT_TINYGRAD_INT_PRODUCTS=1: off by default on AMD, a user's choice): the norm
    # that quantizes its output, q/k/v, the gated unit, quantize_x and the residual products on 16-bit integer x
    os.environ["LEAT_TINYGRAD_INT_PRODUCTS"] = "1"
    model = leat.load(path, backend="tinygrad")
    kv = model.backend.allocate_kv(layouts, slots=1, context=48, dtype=kv_dtype)
    model.backend.set_pages(kv, 0, np.arange(3))
    for row in (Row(0, 0, np.arange(1, 17)), Row(0, 16, np.array([17]))):
        model.backend.to_host(model.backend.run(model.architecture.forward, Batch([row]), kv))


def run_gemv() -> None:
    """gemv.py's kernel of every type it has, for two rows (the tiny model's decode step has one row of Q4_K), and of
    each type with an integer product (Q4_K, Q6_K) on 16-bit integer x (intx.py)."""
    import gguf
    import numpy as np
    from leat_backend_tinygrad import intx
    from leat_backend_tinygrad.gemv import LAYOUTS, as_words, gemv
    from tinygrad import Tensor

    for qtype in LAYOUTS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        stored = as_words(np.zeros((64, 512 // block, size), np.uint8), qtype)
        gemv(Tensor.zeros(2, 512).contiguous(), Tensor(stored), qtype).realize()
        if qtype in intx.DOTS:
            gemv(intx.quantize(Tensor.zeros(2, 512).contiguous()), Tensor(stored), qtype).realize()


def run_attention() -> None:
    """attention.py's decode attention over 128 positions (8 chunks of 16: the combine's lanes; the tiny model's
    slot has 3 chunks, the combine's loop)."""
    from leat_backend_tinygrad.attention import decode_attention
    from tinygrad import Tensor, dtypes

    q, table = Tensor.zeros(1, 4, 64).contiguous(), Tensor.zeros(1, 8, dtype=dtypes.int32).contiguous()
    kv = [Tensor.zeros(128, 2, 64, dtype=dtypes.float16).contiguous() for _ in range(2)]
    decode_attention(q, *kv, table, Tensor([127], dtype=dtypes.int32), 16, 0.125).realize()


def main(path: str, archs: list[str], kv_dtype: str = "f32") -> dict:
    from tinygrad import Device
    from tinygrad.engine import realize
    from tinygrad.engine.worker import get_worker_pool
    from tinygrad.renderer.llvmir import AMDLLVMRenderer

    asts: dict = {}
    to_program_key = realize.to_program_key

    def record(ast, renderer):  # every kernel the runs lower, before lowering
        asts.setdefault(ast.key, ast)
        return to_program_key(ast, renderer)

    realize.to_program_key = record
    began = time.perf_counter()
    run_model(path, kv_dtype)
    report: dict = {"kernels": len(asts), "run_s": round(time.perf_counter() - began, 1)}
    report["gemv"] = sorted(ast.arg.name for ast in asts.values() if ast.arg.name.startswith("gemv_"))
    report["softmax"] = sorted(ast.arg.name for ast in asts.values() if ast.arg.name.startswith("softmax_"))
    report["attention"] = sorted(ast.arg.name for ast in asts.values() if ast.arg.name.startswith("attn_"))
    report["integer"] = sorted(n for n in (ast.arg.name for ast in asts.values()) if "_i16" in n or "quantize_x" in n)
    target = Device[Device.DEFAULT].renderer.target
    tasks = [(ast, AMDLLVMRenderer(replace(target, arch=arch))) for arch in archs for ast in asts.values()]
    began, pool = time.perf_counter(), get_worker_pool()
    jobs = ((i, task, {"NOOPT": 0}) for i, task in enumerate(tasks))
    programs = dict((map if pool is None else pool.imap_unordered)(realize._compile_kernel, jobs))
    report["compile_s"] = round(time.perf_counter() - began, 1)
    for arch in archs:
        found = [check(programs[i].src[-1].arg, arch) for i, (_, r) in enumerate(tasks) if r.target.arch == arch]
        report[arch] = {"kernels": len(found), **{k: max(f[k] for f in found) for k in ("lds", "scratch", "bytes")}}
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("archs", nargs="+", help="AMD targets: gfx1100 (RDNA3), gfx942 (CDNA3), ...")
    parser.add_argument("--kv", default="f32", choices=["f32", "f16", "q8_0"], help="KV cache storage")
    args = parser.parse_args()
    print(json.dumps(main(args.model, args.archs, args.kv)))
