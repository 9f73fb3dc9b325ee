"""Regenerate the KL bases test_perplexity.py checks `leat perplexity --kl-base` against.

Both are llama.cpp's ``llama-perplexity --kl-divergence-base`` output for SmolLM2-135M-Instruct Q4_1 (``leat pull
default``) on text.txt, one chunk of 128 tokens (63 scored positions), gzip-compressed:

* ``smollm2_q4_1_kl_base.bin.gz``: llama.cpp on the Q4_1 file itself. llama.cpp rounds activations to 8 bits before
  every quantized product, so an exact float engine is a few 1e-3 of KL away from it (see DESIGN.md's table).
* ``smollm2_f32_kl_base.bin.gz``: llama.cpp on a copy with every tensor dequantized to F32 by llama.cpp itself
  (``llama_model_quantize`` to ALL_F32): the same weights computed in float, which leat must follow to KL < 1e-3.

Recorded with llama.cpp 0c1e57098 (the vendor/ tree of llama-cpp-python 0.3.36) built for the CPU::

    cmake --build LLAMA_CPP_BUILD --target llama-perplexity
    PYTHON_WITH_LLAMA_CPP core/tests/perplexity_refs/record_kl_base.py LLAMA_CPP_BUILD/bin/llama-perplexity MODEL.gguf
"""

import gzip
import subprocess
import sys
import tempfile
from pathlib import Path

import llama_cpp

HERE = Path(__file__).resolve().parent


def dequantize_to_f32(src: str, dst: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.pure = True
    params.quantize_output_tensor = True
    params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    params.token_embedding_type = llama_cpp.GGML_TYPE_F32
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")


def record(perplexity_bin: str, model: str, out: Path) -> None:
    raw = out.with_suffix("")
    command = [perplexity_bin, "-m", model, "-f", str(HERE / "text.txt"), "-c", "128", "-b", "128", "--chunks", "1"]
    subprocess.run([*command, "-t", "4", "--kl-divergence-base", str(raw)], check=True)
    out.write_bytes(gzip.compress(raw.read_bytes(), compresslevel=9, mtime=0))
    raw.unlink()


def main() -> None:
    perplexity_bin, model = sys.argv[1], sys.argv[2]
    record(perplexity_bin, model, HERE / "smollm2_q4_1_kl_base.bin.gz")
    with tempfile.TemporaryDirectory() as tmp:
        f32 = str(Path(tmp) / "smollm2-f32.gguf")
        dequantize_to_f32(model, f32)
        record(perplexity_bin, f32, HERE / "smollm2_f32_kl_base.bin.gz")


if __name__ == "__main__":
    main()
