#!/usr/bin/env bash
# On the GPU host, after build-ab.sh (same warm machine): `kvmem bench` one cell per argument,
# CONTEXT:CONFIG, in order, copying the results after each cell so that a call cut short keeps
# every finished row.
#   bench-cells.sh 4096:upstream 4096:tiering-off 4096:tiering-on 32768:tiering-on-mtp ...
# configs: upstream, tiering-off, tiering-on (--kvmem-budget 32768), tiering-on-q5 (-ctk/-ctv q5_0:
# a q5_0 host pool under an f16 working set), tiering-on-q5-same (q5_0 on the GPU too), upstream-q5,
# upstream-mtp and tiering-on-mtp (--spec-type draft-mtp on the model with the MTP head); tiering-on-recency
# (--kvmem-method recency: no key or query captures, no scoring: what tiering costs without them).
# REPEATS (default 3) repeats of turn 2 per cell, all on one server after one turn-1 prefill (the prompt
# cache keeps the prefix: a repeat reads 512 new tokens, then generates); FRESH_SERVERS=1 starts a server,
# and so a prefill, per repeat instead (independent prefill repeats, a full prefill each).
# GEN (default 1024) tokens generated at depth. The console output of every cell goes to $OUT/bench-console.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/kv:/tmp/site PATH=/tmp/kv/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
MODEL=/tmp/qwen35-27b.gguf
MODEL_MTP=/tmp/qwen35-27b-mtp.gguf
models="$MODEL"; case " $* " in *mtp*) models="$MODEL $MODEL_MTP" ;; esac  # the MTP file only for MTP cells
for model in $models; do
  if [ ! -f "$model" ]; then
    mtp=""; [ "$model" = "$MODEL_MTP" ] && mtp="--mtp"
    start=$(date +%s)
    kvmem synth --preset qwen35-27b $mtp --quant q4_k --donor .kvmem/ggml-vocab-qwen35.gguf --threads 12 -o "$model" | tail -1
    echo "synth qwen35-27b $mtp: $(( $(date +%s) - start )) s, $(stat -c %s "$model") bytes" | tee -a "$OUT/bench-notes.txt"
  fi
done
GPU="-ngl 99 -fa on -b 2048 -ub 2048"
for cell in "$@"; do
  context=${cell%%:*}; config=${cell#*:}; model=$MODEL
  case $config in
    upstream)       engine=upstream-cuda-sm90; args="$GPU" ;;
    tiering-off)    engine=cuda-sm90; args="$GPU" ;;
    tiering-on)     engine=cuda-sm90; args="$GPU --kvmem-budget 32768" ;;
    tiering-on-recency) engine=cuda-sm90; args="$GPU --kvmem-budget 32768 --kvmem-method recency" ;;
    tiering-on-q5)  engine=cuda-sm90; args="$GPU --kvmem-budget 32768 -ctk q5_0 -ctv q5_0" ;;
    tiering-on-q5-same) engine=cuda-sm90; args="$GPU --kvmem-budget 32768 -ctk q5_0 -ctv q5_0 --kvmem-gpu-type same" ;;
    upstream-q5)    engine=upstream-cuda-sm90; args="$GPU -ctk q5_0 -ctv q5_0" ;;
    upstream-mtp)   engine=upstream-cuda-sm90; args="$GPU --spec-type draft-mtp"; model=$MODEL_MTP ;;
    tiering-on-mtp) engine=cuda-sm90; args="$GPU --kvmem-budget 32768 --spec-type draft-mtp"; model=$MODEL_MTP ;;
    *) echo "unknown config $config"; exit 2 ;;
  esac
  start=$(date +%s)
  fresh=""; [ -n "${FRESH_SERVERS:-}" ] && [ "${FRESH_SERVERS}" != 0 ] && fresh="--fresh-servers"
  kvmem bench --engine "$engine" --model "$model" --config "$config" --contexts "$context" --gen "${GEN:-1024}" --repeats "${REPEATS:-3}" \
    $fresh --server-args "$args" --out /tmp/bench 2>&1 | tee -a "$OUT/bench-console.txt" | tail -2
  echo "cell $cell: $(( $(date +%s) - start )) s" | tee -a "$OUT/bench-notes.txt"
  cp /tmp/bench/results.jsonl "$OUT/"
  tar -czf "$OUT/bench-logs.tar.gz" -C /tmp/bench logs
done
