#!/usr/bin/env bash
# On the GPU host, after build-ab.sh (same warm machine): synthesize the Qwen3.8-27B-shaped model,
# check tiering identity on the GPU, then `kvmem bench` every configuration at each context
# (contexts in the outer loop, so a run cut short still has complete rows for the smaller ones).
#   bench-ab.sh "4096,32768,131072" upstream tiering-off tiering-on
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/kv:/tmp/site PATH=/tmp/kv/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
CONTEXTS=$1; shift
MODEL=/tmp/qwen35-27b.gguf
OURS=$(ls -d ~/.local/share/kvmem/engines/cuda-sm90-* | head -1)
if [ ! -f "$MODEL" ]; then
  start=$(date +%s)
  kvmem synth --preset qwen35-27b --quant q4_k --donor .kvmem/ggml-vocab-qwen35.gguf --threads 12 -o "$MODEL" | tail -1
  echo "synth qwen35-27b: $(( $(date +%s) - start )) s, $(stat -c %s $MODEL) bytes" | tee -a "$OUT/bench-notes.txt"
fi
# GPU identity: budget >= context gives the same greedy tokens as tiering off (synthetic qwen3, f16 KV)
kvmem synth --arch qwen3 --preset tiny --donor .kvmem/ggml-vocab-qwen35.gguf -o /tmp/tiny-qwen3.gguf --force | tail -1
python3 benchmarks/gpu_checks.py --server "$OURS/bin/llama-server" --model /tmp/tiny-qwen3.gguf --out /tmp/gpucheck \
  --identity-only -- -ngl 99 -fa on 2>&1 | tee -a "$OUT/bench-notes.txt"
cp /tmp/gpucheck/gpu_checks.json "$OUT/gpu_identity.json"
GPU="-ngl 99 -fa on -b 2048 -ub 2048"
for context in ${CONTEXTS//,/ }; do
  for config in "$@"; do
    case $config in
      upstream)    engine=upstream-cuda-sm90; args="$GPU" ;;
      tiering-off) engine=cuda-sm90; args="$GPU" ;;
      tiering-on)  engine=cuda-sm90; args="$GPU --kvmem-budget 32768" ;;
      *) echo "unknown config $config"; exit 2 ;;
    esac
    kvmem bench --engine "$engine" --model "$MODEL" --config "$config" --contexts "$context" --gen "${GEN:-1024}" --repeats "${REPEATS:-3}" \
      --server-args "$args" --out /tmp/bench
    cp /tmp/bench/results.jsonl "$OUT/"
  done
done
kvmem bench report --out /tmp/bench --baseline upstream | tail -30
cp /tmp/bench/results.md /tmp/bench/ratios.json /tmp/bench/decode_vs_context.png "$OUT/"
tar -czf "$OUT/bench-logs.tar.gz" -C /tmp/bench logs
