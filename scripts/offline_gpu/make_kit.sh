#!/bin/bash
# Build a self-contained kit for benchmarking leat on a GPU machine that has Python 3.12, CUDA and PyTorch's usual
# packages but no network (the H200 the figures in docs/benchmarks.md come from): leat's wheels, the wheels the
# machine lacks (cp312), llama.cpp's source from the llama-cpp-python sdist (trimmed to what llama-bench and
# llama-batched-bench need), the bench-file generator and its vocabularies, and run.sh.
#
#     bash scripts/offline_gpu/make_kit.sh KIT [VOCAB_DIR]
#
# VOCAB_DIR holds ggml-vocab-llama-bpe.gguf, ggml-vocab-qwen2.gguf and ggml-vocab-deepseek-llm.gguf (llama.cpp's
# models/ folder; make_bench_gguf.py's docstring); those it lacks are taken from the sdist. Copy KIT to the
# machine (or into an ignored folder of the checkout that travels with it) and run its run.sh from the checkout.
set -euo pipefail
kit=${1:?usage: make_kit.sh KIT [VOCAB_DIR]}
vocab=${2:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$kit"/leat "$kit"/whl "$kit"/vocab
rm -f "$kit"/leat/*.whl
(cd "$root" && uv build --all-packages --wheel -o "$kit/leat" -q)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$kit/whl" "gguf==0.19.0" "msgspec==0.23.0" "tinygrad==0.14.0"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary=:all: "llama-cpp-python==0.3.36" -d "$tmp"  # a minute: pip prepares it
tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
for name in ggml-vocab-llama-bpe.gguf ggml-vocab-qwen2.gguf ggml-vocab-deepseek-llm.gguf; do
    if [ -n "$vocab" ] && [ -f "$vocab/$name" ]; then cp "$vocab/$name" "$kit/vocab/"; else cp "$src/models/$name" "$kit/vocab/"; fi
done
(cd "$src" && rm -rf models docs media benches gguf-py conversion tools/ui \
    ggml/src/ggml-{webgpu,et,metal,hexagon,sycl,vulkan,opencl,cann,musa,openvino,virtgpu,zdnn,zendnn})
tar cJf "$kit/llama.tar.xz" -C "$(dirname "$src")" llama.cpp
rm -rf "$tmp"
cp "$root/scripts/bench/make_bench_gguf.py" "$root/scripts/offline_gpu/run.sh" "$kit/"
du -sh "$kit"
