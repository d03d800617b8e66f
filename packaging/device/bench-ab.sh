#!/usr/bin/env bash
# On the GPU host, after build-ab.sh (same warm machine): synthesize the Qwen3.8-27B-shaped model
# and run `kvmem bench` for the given configurations and contexts.
#   bench-ab.sh "4096,32768,131072" upstream tiering-off tiering-on
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/kv:/tmp/site PATH=/tmp/kv/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
CONTEXTS=$1; shift
MODEL=/tmp/qwen35-27b.gguf
if [ ! -f "$MODEL" ]; then
  start=$(date +%s)
  kvmem synth --preset qwen35-27b --quant q4_k --donor .kvmem/ggml-vocab-qwen35.gguf --threads 12 -o "$MODEL" | tail -2
  echo "synth: $(( $(date +%s) - start )) s" | tee -a "$OUT/bench-notes.txt"
fi
GPU="-ngl 99 -fa on -b 2048 -ub 2048"
for config in "$@"; do
  case $config in
    upstream)    engine=upstream-cuda-sm90; args="$GPU" ;;
    tiering-off) engine=cuda-sm90; args="$GPU" ;;
    tiering-on)  engine=cuda-sm90; args="$GPU --kvmem-budget 32768" ;;
    *) echo "unknown config $config"; exit 2 ;;
  esac
  kvmem bench --engine "$engine" --model "$MODEL" --config "$config" --contexts "$CONTEXTS" --gen 64 \
    --server-args "$args" --out /tmp/bench
done
kvmem bench report --out /tmp/bench --baseline upstream | tail -30
cp /tmp/bench/results.jsonl /tmp/bench/results.md /tmp/bench/ratios.json /tmp/bench/decode_vs_context.png "$OUT/"
tar -czf "$OUT/bench-logs.tar.gz" -C /tmp/bench logs
