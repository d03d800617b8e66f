#!/usr/bin/env bash
# Issue 27 on the H200 in one background job: build our sm_90 engine (default FA quants, no web UI), write the
# synthetic qwen35 27B, then per cell a tiered session read once, saved, answered by the never-stopped server,
# killed (SIGKILL), restarted and restored (benchmarks/bench_sessions.py --restart, page cache emptied before
# each restore).
#   here:      bash packaging/device/issue24.sh stage     (wheels, the source pack, the qwen35 vocabulary)
#   call 1:    bash packaging/device/issue27.sh start     (carry: [".whl", ".kvmem"])
#   calls 2..: bash packaging/device/issue27.sh wait 540  (returns when a step lands, the job ends, or after 540 s;
#              issue the next call within the machine's 30 s idle window)
# CELLS overrides the cells (TOKENS:POOL, POOL f16 or q5_0); REPEATS (3) restores per cell after one restart.
set -uo pipefail
CELLS=${CELLS:-"261400:f16 261400:q5_0 131072:f16"}
. "$(dirname "$0")/job.sh"
case "${1:-}" in
start)
  job_start packaging/device/issue27.sh ;;
run)
  job_setup
  { nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv; nproc; free -g | head -2
    df -h /tmp | tail -1; id -u; } | tee "$OUT/host.txt"
  job_build
  kvmem engines --json > "$OUT/engines.json"
  MODEL=/tmp/qwen35-27b.gguf
  start=$(date +%s)
  kvmem synth --preset qwen35-27b --quant q4_k --donor .kvmem/ggml-vocab-qwen35.gguf --threads 12 -o "$MODEL" | tail -1
  echo "synth qwen35-27b: $(( $(date +%s) - start )) s, $(stat -c %s "$MODEL") bytes" | tee -a "$OUT/notes.txt"
  GPU="-ngl 99 -fa on -b 2048 -ub 2048"
  for cell in $CELLS; do
    tokens=${cell%%:*}; pool=${cell#*:}; args="$GPU"
    [ "$pool" = q5_0 ] && args="$GPU -ctk q5_0 -ctv q5_0"
    ctx=$(( tokens + 744 )); [ "$ctx" -gt 262144 ] && ctx=262144
    start=$(date +%s); mkdir -p /tmp/sessions
    python3 benchmarks/bench_sessions.py --engine cuda-sm90 --model "$MODEL" --tokens "$tokens" --ctx "$ctx" \
      --budget 32768 --server-args "$args" --restart --repeats "${REPEATS:-3}" --gen 16 --drop-caches \
      --dir /tmp/sessions --json "$OUT/restart-$tokens-$pool.json" 2>&1 | tee -a "$OUT/console.txt" | tail -12
    echo "cell $cell: $(( $(date +%s) - start )) s" | tee -a "$OUT/notes.txt"
  done
  echo "ALL DONE" ;;
wait)
  job_wait "$0" "${2:-540}" host.txt notes.txt
  exec bash "$0" poll ;;
poll)
  cp -r /tmp/out/. "$OUT"/ 2>/dev/null
  tail -n "${LINES_BACK:-25}" /tmp/out/run.log; cat /tmp/out/notes.txt 2>/dev/null ;;
*) echo "usage: $0 start|wait [SECONDS]|poll"; exit 2 ;;
esac
