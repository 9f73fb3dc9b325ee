#!/bin/bash
# One call on the lent H200 (the device tool's `run`): environment, kernel build, GPU tests, bench.
# Run from the repository root with carry [".whl", "local"], where .whl holds the gguf wheel for
# cp312 (the device has no gguf) and local/bench holds a copy of shared/bench/make_bench_gguf.py and
# its vocab/ folder (both folders ignored by git). Logs go to $OUT; see NOTES.md.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/core/src:$PWD/backends/cpu/src:$PWD/backends/cuda/src:$PWD/architectures/llama/src:$PWD/plugins/samplers/src
export LEAT_HOME=/tmp/leat
(python3 local/bench/make_bench_gguf.py llama3-8b /tmp/l8b.gguf > $OUT/make.log 2>&1; echo done >> $OUT/make.log) &
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee $OUT/env.txt
python3 -c "
import cuda.bindings, numpy, sys
from leat_backend_cuda import compiler, driver
print('python', sys.version.split()[0], 'cuda-bindings', cuda.bindings.__version__, 'numpy', numpy.__version__, 'nvrtc', compiler.nvrtc_version())
print('probe:', driver.probe())
d = driver.Device(); print(d.name, d.arch, 'driver', d.driver_version, 'SMs', d.sm_count, 'smem optin', d.smem_optin)
" 2>&1 | tee -a $OUT/env.txt
timeout 150 python3 -m leat_backend_cuda.build 2>&1 | tail -3 | tee $OUT/build.log
timeout 240 python3 -m pytest backends/cuda/tests -m gpu -q -p no:cacheprovider --maxfail=20 2>&1 > $OUT/tests.log; echo "pytest rc $?"
grep -E "passed|failed|Error|error" $OUT/tests.log | tail -5
grep -E "^FAILED|^ERROR" $OUT/tests.log | head -20
wait
tail -2 $OUT/make.log
timeout 200 python3 -m leat_backend_cuda.bench /tmp/l8b.gguf --architecture leat_arch_llama.llama:Llama --reps 3 --depth 4096 --batch 8 32 --profile --json $OUT/bench.json 2>&1 > $OUT/bench.log; grep -a -E "^\| (pp|tg)|^#|Error" $OUT/bench.log; grep -E "passed|failed" $OUT/tests.log | tail -2
