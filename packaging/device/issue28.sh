#!/usr/bin/env bash
# Issue 28 on the H200 in one background job: three of the six SM packages, one `kvmem build --sm NN` after another
# (the engine's FA pairs, the web UI built here and carried, ccache under /tmp shared by the builds), each packaged
# with its machine code listed (cuobjdump); then the checks: `kvmem engines install` of the sm_89 package refused on
# this sm_90 GPU, and the sm_90 package installed into a fresh store and smoke-tested (llama-server answers, tiering
# ARMED, greedy tokens equal to the CPU engine's, recorded here).
#   here:      bash packaging/device/issue28.sh stage     (wheels, the source pack, the web UI, SmolLM2 in 2 parts in
#                                                         .parts/00 and .parts/01, the CPU engine's tokens)
#   call 1:    bash packaging/device/issue28.sh start     (carry: [".whl", ".kvmem"])
#   calls 2..: bash packaging/device/issue28.sh wait 540  (calls 2 and 3 carry .parts/00 and .parts/01; returns when a
#              step lands, the job ends, or after 540 s; issue the next call within the machine's 30 s idle window)
# SMS (env, call 1): the targets, in order (default "90 89 120a": sm_90 for the smoke test, sm_89 for the refusal).
set -uo pipefail
SMS=${SMS:-"90 89 120a"}
MODEL=/tmp/smollm2.gguf
. "$(dirname "$0")/job.sh"
case "${1:-}" in
stage)
  cd "$(dirname "$0")/../.."
  bash packaging/device/issue24.sh stage || exit 1
  rm -f .kvmem/ggml-vocab-qwen35.gguf .kvmem/webui-*.tar.xz  # no synthetic model here; a stale UI would travel
  ui=$(python3 -c "
from kvmem_llama import build, webui
plan = build.plan_build(dry_run=True)
print(webui.source_hash(plan.src / webui.UI_SUBDIR)[:16])") || exit 1
  [ -f ~/.cache/kvmem/webui/"$ui"/dist/index.html ] || { echo "no built web UI $ui: run kvmem build here first"; exit 1; }
  tar -C ~/.cache/kvmem/webui -cJf ".kvmem/webui-$ui.tar.xz" "$ui/dist"
  gguf=$(python3 -c "from kvmem_llama.default_model import default_model_path; print(default_model_path())") || exit 1
  rm -rf .parts && mkdir -p .parts/00 .parts/01
  split -n 2 -d -a 2 "$gguf" .parts/smollm2.gguf.part
  mv .parts/smollm2.gguf.part00 .parts/00/ && mv .parts/smollm2.gguf.part01 .parts/01/
  echo "smollm2.gguf $(sha256sum "$gguf" | cut -d' ' -f1) 2" > .kvmem/models.txt
  cpu=$(python3 -c "from kvmem_llama.engine import list_engines; print(next(e.server for e in list_engines() if not e.sms))")
  python3 packaging/device/engine_smoke.py --server "$cpu" --model "$gguf" --write .kvmem/smoke-expected.json || exit 1
  du -sh .whl .kvmem .parts/* ;;
start)
  job_start packaging/device/issue28.sh ;;
run)
  job_setup
  { nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv; nproc; nvcc --version | tail -2
    command -v ccache cuobjdump; } | tee "$OUT/host.txt"
  mkdir -p ~/.cache/kvmem/webui && for ui in .kvmem/webui-*.tar.xz; do tar -C ~/.cache/kvmem/webui -xJf "$ui"; done
  mkdir -p /tmp/dist
  for sm in $SMS; do
    start=$(date +%s)
    kvmem build --sm "$sm" -j "$(nproc)" 2>&1 | tail -4
    took=$(( $(date +%s) - start ))
    engine=$(ls -d ~/.local/share/kvmem/engines/cuda-sm"$sm"-* 2>/dev/null | head -1)
    [ -n "$engine" ] || { echo "sm $sm: no engine after ${took} s" | tee -a "$OUT/notes.txt"; continue; }
    kvmem engines package "$(basename "$engine")" -o /tmp/dist | tail -1
    cp "$engine/build-info.json" "$OUT/build-info-sm$sm.json"
    lib=$(find "$engine" -name 'libggml-cuda.so*' -type f | head -1)
    { echo "\$ cuobjdump --list-elf $(basename "$lib")"; cuobjdump --list-elf "$lib"
      echo "\$ cuobjdump --list-ptx $(basename "$lib")"; cuobjdump --list-ptx "$lib"; } > "$OUT/cuobjdump-sm$sm.txt" 2>&1
    package=$(ls /tmp/dist/kvmem-engine-"$(basename "$engine")".tar.gz)
    echo "sm $sm: build ${took} s (wall), package $(stat -c %s "$package") bytes," \
      "machine code $(grep -oE 'sm_[0-9]+a?' "$OUT/cuobjdump-sm$sm.txt" | sort -u | tr '\n' ' ')" | tee -a "$OUT/notes.txt"
    cp /tmp/dist/SHA256SUMS "$OUT/"
  done
  ccache -s > "$OUT/ccache.txt" 2>&1
  python3 packaging/make_packages.py --describe /tmp/dist > "$OUT/packages.json"
  for package in /tmp/dist/kvmem-engine-cuda-sm*.tar.gz; do  # every package on this sm_90 GPU: sm_90's goes in
    name=$(basename "$package" .tar.gz)
    { echo "\$ kvmem engines install $(basename "$package")"; KVMEM_HOME=/tmp/fresh kvmem engines install "$package"
      echo "exit code: $?"; } > "$OUT/install-${name#kvmem-engine-cuda-}.txt" 2>&1
    echo "install $name: $(tail -1 "$OUT/install-${name#kvmem-engine-cuda-}.txt")" | tee -a "$OUT/notes.txt"
  done
  deadline=$(( $(date +%s) + 600 ))  # the model's parts arrive with calls 2 and 3
  until PARTS_DIR=/tmp/parts DEST=/tmp bash packaging/device/issue25.sh assemble >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "no model: parts missing" | tee -a "$OUT/notes.txt"; break; }
    sleep 5
  done
  fresh=$(ls -d /tmp/fresh/engines/cuda-sm90-* 2>/dev/null | head -1)
  if [ -n "$fresh" ] && [ -f "$MODEL" ]; then
    python3 packaging/device/engine_smoke.py --server "$fresh/bin/llama-server" --model "$MODEL" \
      --expect .kvmem/smoke-expected.json --out "$OUT/smoke-sm90.json" -- -ngl 99 -fa on 2>&1 | tee "$OUT/smoke-sm90.txt"
    echo "smoke sm_90: $(grep -c PASS "$OUT/smoke-sm90.txt") of 3 checks passed" | tee -a "$OUT/notes.txt"
  fi
  echo "ALL DONE" ;;
take)
  mkdir -p /tmp/parts && cp .parts/*/* /tmp/parts/ 2>/dev/null; echo "$(ls /tmp/parts | wc -l) parts on this machine" ;;
wait)
  [ -d .parts ] && bash "$0" take
  job_wait "$0" "${2:-540}" notes.txt
  exec bash "$0" poll ;;
poll)
  cp -r /tmp/out/. "$OUT"/ 2>/dev/null
  tail -n "${LINES_BACK:-15}" /tmp/out/run.log; cat /tmp/out/notes.txt 2>/dev/null ;;
*) echo "usage: $0 stage|start|wait [SECONDS]|poll"; exit 2 ;;
esac
