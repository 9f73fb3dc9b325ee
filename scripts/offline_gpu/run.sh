#!/bin/bash
# Benchmark phases on a GPU machine without network, from a kit made by make_kit.sh (beside this script), run from
# a leat checkout (the tests and scripts/ come from there):
#
#     bash KIT/run.sh setup "build_llama 12" "gen llama3-8b l8b.gguf" "cuda base" "vs l8b.gguf 300 --reps=3"
#
# or, with the phases of the checkout rather than the kit's copy (which make_kit.sh took when it ran):
#
#     KIT=KIT bash scripts/offline_gpu/run.sh setup ...
#
# Each argument is one phase and its words. Results go to $OUT (default ./kit-out): each `leat bench` row's mean,
# deviation, warm-up and per-run rates are appended to summary.txt. Phases:
#   setup                      install the kit's wheels into /tmp/site (leat's, and those the machine lacks)
#   oldsite [NAME]             install the wheels in KIT/NAME (default old: another build of a plugin) into
#                              /tmp/site_NAME; run a phase with PYTHONPATH=/tmp/site_NAME:/tmp/site to time that build
#   build_llama [JOBS]         build llama-bench and llama-batched-bench with CUDA for sm_90, in the background
#   llwait [SECONDS]           wait for that build
#   gen KIND NAME [LAYERS]     write make_bench_gguf.py's KIND to /tmp/g/NAME (genbg: in the background; wait)
#   cuda LABEL [VAR=VALUE...]  leat bench /tmp/g/l8b.gguf on the CUDA backend, pp512 and tg128, 3 runs
#   tg LABEL [VAR=VALUE...]    the same on tinygrad (DEV=CUDA), 2 runs
#   bench LABEL FILE ARGS [VAR=VALUE...]
#                              leat bench /tmp/g/FILE on the CUDA backend with ARGS, its words joined by +
#                              (-p+0+-n+128+-d+0,4096+-r+3); an A/B is such phases alternating, each with its switches
#   cudatests [SECONDS] [N]    the CUDA backend's GPU tests (N: xdist workers), cut at SECONDS with a tally of the
#                              outcomes so far (about 240 s alone on an H200; more beside a llama.cpp build);
#   tgtests [SECONDS] [N]      the same for the tinygrad backend's tests (DEV=CUDA)
#   vs FILE [SECONDS] [ARGS]   scripts/vs_llamacpp.py on /tmp/g/FILE beside the llama.cpp just built
#   sh COMMAND...              any command
#   pack DIR                   $OUT as one archive, DIR/kit-out.tgz (where a machine returns only a few files: run
#                              with OUT outside the returned folder and pack into it at the end)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site LEAT_HOME=/tmp/leat PATH=/tmp/site/bin:$PATH
K=$(cd "${KIT:-$(dirname "$0")}" && pwd)
OUT=${OUT:-$PWD/kit-out}
mkdir -p "$OUT"
G=/tmp/g
mkdir -p $G
log() { echo "## $(date +%T) $*" | tee -a $OUT/phases.log; }
bench() { # LABEL FILE BACKEND ARGS... (env set by caller)
  local label=$1 file=$2 be=$3; shift 3
  log "bench $label"
  timeout 300 python3 -m leat bench $file --backend $be --kv f16 "$@" --concurrency '' --json > $OUT/b_$label.json 2> $OUT/b_$label.err
  echo "rc $?" >> $OUT/b_$label.err
  python3 -c "
import json
for r in json.load(open('$OUT/b_$label.json')): print('$label', r['test'], '%.2f +- %.2f' % (r['tokens_per_second'], r['stdev']), 'warm %.1f' % r['warmup_seconds'], [round(x, 1) for x in r['rates']])
" 2>&1 | tee -a $OUT/summary.txt; tail -2 $OUT/b_$label.err
}
gputests() { # NAME SECONDS WORKERS PYTEST_ARGS...: run, cut at SECONDS (xdist's workers too), tally the outcomes
  local name=$1 secs=$2 workers=$3; shift 3
  # -v: a line a test as it ends (with xdist `[gwN] [ P%] OUTCOME path::test`), so a cut run still names its failures
  setsid python3 -m pytest "$@" -v -p no:cacheprovider ${workers:+-n $workers} > $OUT/$name.log 2>&1 &
  local tests=$!; for i in $(seq 1 $secs); do kill -0 $tests 2>/dev/null || break; sleep 1; done
  kill -0 $tests 2>/dev/null && { kill -9 -- -$tests; echo "cut at $secs s"; }
  grep -E "^=+ .*(passed|failed|skipped).* =+$" $OUT/$name.log | tail -1
  grep -E "(\] |^[^ ]+::[^ ]+ )(FAILED|ERROR)" $OUT/$name.log | head -20  # the progress lines, not -ra's summary
  # one outcome a test line (xdist's `] OUTCOME path::` or plain `path::test OUTCOME`), not the -ra summary's
  grep -E "::" $OUT/$name.log | grep -oE "(\] | )(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)( |$)" | tr -d '] ' | sort |
    uniq -c | tr '\n' ' '; echo
}
for phase in "$@"; do
  set -- $phase
  case $1 in
  setup)
    log setup
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $K/whl/*.whl $K/leat/*.whl > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee $OUT/env.txt ;;
  build_llama)
    log build_llama
    (cd /tmp && tar xJf $K/llama.tar.xz && cd llama.cpp && setsid nohup bash -c "cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > /tmp/llb.log 2>&1 && cmake --build b -j ${2:-10} --target llama-bench llama-batched-bench >> /tmp/llb.log 2>&1; echo BUILD_DONE \$? >> /tmp/llb.log" > /dev/null 2>&1 &) ;;
  gen)  # gen KIND NAME [LAYERS]
    log gen $2; python3 $K/make_bench_gguf.py $2 $G/$3 ${4:+--layers $4} > $OUT/gen_$3.log 2>&1; ls -la $G/$3 ;;
  genbg)
    log genbg $2; (python3 $K/make_bench_gguf.py $2 $G/$3 ${4:+--layers $4} > $OUT/gen_$3.log 2>&1; echo done >> $OUT/gen_$3.log) & ;;
  wait)
    log wait; wait ;;
  llwait)
    log llwait; for i in $(seq 1 ${2:-300}); do grep -q BUILD_DONE /tmp/llb.log 2>/dev/null && break; sleep 1; done; tail -2 /tmp/llb.log ;;
  cuda)  # cuda LABEL [ENV=..]...
    label=$2; shift 2; (for e in "$@"; do export "$e"; done; bench $label $G/l8b.gguf cuda -p 512 -n 128 -r 3) ;;
  bench)  # bench LABEL FILE ARGS [ENV=..]...
    label=$2 file=$3 args=$4; shift 4; (for e in "$@"; do export "$e"; done; bench $label $G/$file cuda ${args//+/ }) ;;
  tg)  # tg LABEL [ENV=..]...
    label=$2; shift 2; (export DEV=CUDA; for e in "$@"; do export "$e"; done; bench $label $G/l8b.gguf tinygrad -p 512 -n 128 -r 2) ;;
  cudatests)  # cudatests [SECONDS] [WORKERS]: killed whole (xdist's workers too) at SECONDS; the tally even then
    log cudatests; gputests cudatests "${2:-240}" "$3" backends/cuda/tests -m gpu ;;
  tgtests)  # tgtests [SECONDS] [WORKERS]: the same for the tinygrad backend's tests on DEV=CUDA
    log tgtests; (export DEV=CUDA; gputests tgtests "${2:-200}" "$3" backends/tinygrad/tests) ;;
  vs)  # vs FILE TIMEOUT "ARGS"
    log vs $2; timeout ${3:-300} python3 scripts/vs_llamacpp.py $G/$2 --llama-bin /tmp/llama.cpp/b/bin "${@:4}" --json $OUT/vs_$2.json 2>&1 | tee $OUT/vs_$2.txt | tail -14 ;;
  oldsite)  # oldsite [NAME]
    n=${2:-old}; log oldsite $n; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_$n $K/$n/*.whl > $OUT/pip$n.log 2>&1; ls /tmp/site_$n ;;
  sh)
    shift; log sh "$@"; eval "$@" ;;
  pack)
    log pack; tar czf "$2/kit-out.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" ;;
  *) echo "unknown phase $1" ;;
  esac
done
log end
