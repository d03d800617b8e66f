#!/usr/bin/env bash
# On the GPU host, call 1 of the A/B benchmark: build our sm_90 engine and the unpatched
# upstream at the same pin (ccache makes the second build reuse ggml-cuda), package ours and
# install the package into a fresh store through `kvmem engines install`. Both builds use upstream's
# default flash-attention type set (f16/bf16/q8_0/q4_0 pairs; the benchmark runs f16 KV): half the
# build time of `--fa-quants all`, which the shipped packages use.
set -uo pipefail
OUT=${OUT:-/tmp/out}
. packaging/device/setup-env.sh
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee "$OUT/host.txt"
for flavour in "" "--upstream"; do
  start=$(date +%s)
  kvmem build --sm 90 -j "$(nproc)" --fa-quants default $flavour 2>&1 | tail -3
  echo "build ${flavour:-ours}: $(( $(date +%s) - start )) s" | tee -a "$OUT/host.txt"
done
ccache -s | tee -a "$OUT/host.txt" | head -12
kvmem engines --json > "$OUT/engines.json"
