#!/usr/bin/env bash
# Issue 26 on the GPU in one background job: build our sm_90 engine (FA_QUANTS, default: upstream's set; no web UI;
# FA_QUANTS=engine after an issue24.sh run with q5_0 cells on the same warm machine reuses its build), write the
# synthetic qwen35 27B model with its vision projector and a test image, then `kvmem bench --image` cells, most
# wanted first: the image IMAGE_AT tokens into a CONTEXT-token conversation, decoded after at depth, tiering off and on.
#   here:      bash packaging/device/issue24.sh stage      (the same wheels, source pack and vocabulary)
#   call 1:    bash packaging/device/issue26.sh start      (carry: [".whl", ".kvmem"])
#   calls 2..: bash packaging/device/issue26.sh wait 540   (as issue24.sh)
# CELLS overrides the cells (CONTEXT:tiering-off|tiering-on); REPEATS (3) turns per cell; IMAGE (896) its side;
# IMAGE_AT (4096) tokens of text before it (past the sink and the recent window, so that its block can leave).
set -uo pipefail
CELLS=${CELLS:-"32768:tiering-off 32768:tiering-on 131072:tiering-on 131072:tiering-off"}
. "$(dirname "$0")/job.sh"
case "${1:-}" in
start)
  job_start packaging/device/issue26.sh ;;
run)
  job_setup
  { nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv; nproc; } | tee "$OUT/host.txt"
  job_build
  start=$(date +%s)
  kvmem synth --preset qwen35-27b --quant q4_k --donor .kvmem/ggml-vocab-qwen35.gguf --threads 12 \
    -o /tmp/qwen35-27b.gguf --mmproj /tmp/mmproj-27b.gguf | tail -2
  python3 -c "from kvmem_llama.synth_vision import synthetic_png as p; open('/tmp/image.png', 'wb').write(p(${IMAGE:-896}, ${IMAGE:-896}, 1))"
  echo "synth qwen35-27b + projector + image: $(( $(date +%s) - start )) s" | tee -a "$OUT/bench-notes.txt"
  GPU="-ngl 99 -fa on -b 2048 -ub 2048 --mmproj /tmp/mmproj-27b.gguf"
  for cell in $CELLS; do
    context=${cell%%:*}; config=${cell#*:}; args="$GPU"
    [ "$config" = tiering-on ] && args="$GPU --kvmem-budget 32768"
    start=$(date +%s)
    kvmem bench --engine cuda-sm90 --model /tmp/qwen35-27b.gguf --config "image-$config" --contexts "$context" \
      --gen "${GEN:-1024}" --repeats "${REPEATS:-3}" --image /tmp/image.png --image-at "${IMAGE_AT:-4096}" \
      --server-args "$args" --out /tmp/bench 2>&1 | tee -a "$OUT/bench-console.txt" | tail -2
    echo "cell $cell: $(( $(date +%s) - start )) s" | tee -a "$OUT/bench-notes.txt"
    cp /tmp/bench/results.jsonl "$OUT/"
    tar -czf "$OUT/bench-logs.tar.gz" -C /tmp/bench logs
  done
  echo "ALL DONE" ;;
wait)
  job_wait "$0" "${2:-540}" host.txt bench-notes.txt
  cp -r /tmp/out/. "$OUT"/ 2>/dev/null
  tail -n "${LINES_BACK:-25}" /tmp/out/run.log; grep -h "^cell " /tmp/out/bench-notes.txt 2>/dev/null ;;
*) echo "usage: $0 start|wait [SECONDS]"; exit 2 ;;
esac
