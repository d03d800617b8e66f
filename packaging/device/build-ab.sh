#!/usr/bin/env bash
# On the GPU host, call 1 of the A/B benchmark: build our sm_90 engine and the unpatched
# upstream at the same pin (ccache makes the second build reuse ggml-cuda), package ours and
# install the package into a fresh store through `kvmem engines install`.
set -uo pipefail
OUT=${OUT:-/tmp/out}
. packaging/device/setup-env.sh
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee "$OUT/host.txt"
for flavour in "" "--upstream"; do
  start=$(date +%s)
  kvmem build --sm 90 -j "$(nproc)" $flavour 2>&1 | tail -3
  echo "build ${flavour:-ours}: $(( $(date +%s) - start )) s" | tee -a "$OUT/host.txt"
done
ccache -s | tee -a "$OUT/host.txt" | head -12
kvmem engines --json > "$OUT/engines.json"
OURS=$(kvmem engines --json | python3 -c "import json,sys; print(next(r['key'] for r in json.load(sys.stdin) if r['target']=='cuda-sm90' and not r['key'].startswith('upstream')))")
kvmem engines package "$OURS" -o /tmp/dist | tail -1
KVMEM_HOME=/tmp/fresh kvmem engines install "/tmp/dist/kvmem-engine-$OURS.tar.gz" | tee "$OUT/install.txt"
cp /tmp/dist/SHA256SUMS "$OUT/"
cp "/tmp/fresh/engines/$OURS/build-info.json" "$OUT/build-info-sm90.json"
