#!/usr/bin/env bash
# On the GPU host: build the sm_90 engine from the carried source pack, package it, and
# install the package into a fresh store through `kvmem engines install` (sha + SM checks).
set -uo pipefail
OUT=${OUT:-/tmp/out}
. packaging/device/setup-env.sh
{ nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv; nproc; nvcc --version | tail -2
  command -v ccache || echo "no ccache"; } | tee "$OUT/host.txt"
/usr/bin/time -v kvmem build --sm 90 -j "$(nproc)" 2>&1 | tee "$OUT/build.log" | grep -vE '^\s+(Page|Vol|Invol|Swap|File|Socket|Signal|Average|Exit|Minor|Major)'
kvmem engines package -o /tmp/dist
KVMEM_HOME=/tmp/fresh kvmem engines install /tmp/dist/kvmem-engine-cuda-sm90-*.tar.gz | tee "$OUT/install.txt"
cp /tmp/dist/SHA256SUMS "$OUT/"; ls -la /tmp/dist >> "$OUT/install.txt"
E=$(ls -d /tmp/fresh/engines/cuda-sm90-*)
cp "$E/build-info.json" "$OUT/build-info-sm90.json"
"$E/bin/llama-server" --version 2>&1 | tee -a "$OUT/install.txt"
