#!/usr/bin/env bash
# On the GPU host, after build-ab.sh: tiering correctness on the GPU engine.
#   gpu-checks.sh identity      synthetic tiny qwen3 and qwen35 (hybrid): budget >= context == tiering off
#   gpu-checks.sh needle SMOL   SmolLM2-135M (the GGUF, reassembled from carried parts): identity + needle
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/kv:/tmp/site PATH=/tmp/kv/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
OURS=$(ls -d ~/.local/share/kvmem/engines/cuda-sm90-* | head -1)
case $1 in
  identity)
    for arch in qwen3 qwen35; do
      kvmem synth --arch $arch --preset tiny --donor .kvmem/ggml-vocab-qwen35.gguf -o /tmp/tiny-$arch.gguf --force | tail -1
      python3 benchmarks/gpu_checks.py --server "$OURS/bin/llama-server" --model /tmp/tiny-$arch.gguf \
        --out /tmp/gpucheck-$arch --identity-only -- -ngl 99 -fa on 2>&1 | tee -a "$OUT/gpu-checks.txt"
      cp /tmp/gpucheck-$arch/gpu_checks.json "$OUT/gpu_identity_$arch.json"
    done ;;
  needle)
    python3 benchmarks/gpu_checks.py --server "$OURS/bin/llama-server" --model "$2" --out /tmp/gpucheck-smol \
      -- -ngl 99 -fa on 2>&1 | tee -a "$OUT/gpu-checks.txt"
    cp /tmp/gpucheck-smol/gpu_checks.json "$OUT/gpu_needle_smollm2.json" ;;
  *) echo "usage: gpu-checks.sh identity | needle MODEL"; exit 2 ;;
esac
