"""Record ggml's own CPU matmul of quantized weights: the reference test_ggml_activations.py checks
``activations="ggml"`` against.

Builds a 30-line C program against a llama.cpp source tree built for the CPU (its ``ggml/include`` and
``build/bin``), runs ``ggml_mul_mat`` of each weight type by the same float32 activations, and writes
``ggml_matmul.npz`` here (committed): ``x`` [4, 512] float32, and per type NAME ``NAME/weight`` (the GGUF bytes,
[16, row bytes] uint8) and ``NAME/y`` [4, 16] float32, ggml's result. Run from leat's environment::

    uv run python backends/cpu/tests/references/record_ggml_matmul.py /path/to/llama.cpp

Recorded with llama.cpp's ggml 0.25.3 (x86-64, AVX-512 build).
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
HERE = Path(__file__).resolve().parent
ROWS, COLS, N = 16, 512, 4
TYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"]

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
#include "ggml-cpu.h"
// mm TYPE ROWS COLS N DIR: y = mul_mat(w, x), w [ROWS, COLS] of TYPE from DIR/w.bin, x [N, COLS] f32 from DIR/x.bin
static void io(const char *dir, const char *name, const char *mode, void *data, size_t size) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, mode);
    if (!f || (mode[0] == 'r' ? fread(data, 1, size, f) : fwrite(data, 1, size, f)) != size) exit(1);
    fclose(f);
}
int main(int argc, char **argv) {
    int type = atoi(argv[1]), rows = atoi(argv[2]), cols = atoi(argv[3]), n = atoi(argv[4]);
    struct ggml_init_params params = {64u << 20, NULL, false};
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *w = ggml_new_tensor_2d(ctx, type, cols, rows);
    struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, cols, n);
    io(argv[5], "w.bin", "rb", w->data, ggml_nbytes(w));
    io(argv[5], "x.bin", "rb", x->data, ggml_nbytes(x));
    struct ggml_tensor *y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph *graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    ggml_graph_compute_with_ctx(ctx, graph, 1);
    io(argv[5], "y.bin", "wb", y->data, ggml_nbytes(y));
    return 0;
}
"""


def weight_bytes(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    values = (rng.standard_normal((ROWS, COLS)) * 0.1).astype(np.float32)
    try:
        return gguf.quants.quantize(values, qtype).view(np.uint8).reshape(ROWS, -1)
    except (NotImplementedError, gguf.quants.QuantError):  # gguf-py cannot quantize K-quants: random blocks
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (ROWS, COLS // block, size), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if qtype == Q.Q6_K:  # ..., fp16 d last
            blocks[..., -2:] = scale
        else:  # Q4_K: fp16 d, fp16 dmin first
            blocks[..., 0:2] = blocks[..., 2:4] = scale
        return blocks.reshape(ROWS, -1)


def main() -> None:
    llama = Path(sys.argv[1]).resolve()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((N, COLS)) * np.exp(rng.standard_normal((N, COLS)))).astype(np.float32)
    out = {"x": x}
    with tempfile.TemporaryDirectory() as tmp:
        source, program = Path(tmp) / "mm.c", Path(tmp) / "mm"
        source.write_text(PROGRAM)
        lib = llama / "build" / "bin"
        subprocess.run(
            ["cc", "-O2", source, f"-I{llama / 'ggml' / 'include'}", f"-L{lib}", "-lggml", "-lggml-base"]
            + ["-lggml-cpu", f"-Wl,-rpath,{lib}", "-o", program],
            check=True,
        )
        x.tofile(Path(tmp) / "x.bin")
        for name in TYPES:
            weight = weight_bytes(Q[name], rng)
            weight.tofile(Path(tmp) / "w.bin")
            subprocess.run([program, str(int(Q[name])), str(ROWS), str(COLS), str(N), tmp], check=True)
            out[f"{name}/weight"] = weight
            out[f"{name}/y"] = np.fromfile(Path(tmp) / "y.bin", np.float32).reshape(N, ROWS)
    np.savez_compressed(HERE / "ggml_matmul.npz", **out)


if __name__ == "__main__":
    main()
