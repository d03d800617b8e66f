#!/usr/bin/env bash
# Issue 25 on the H200 in one background job: the sm_90 engine, then `kvmem eval` of the decoy / two-hop / plain needle
# tasks on Qwen2.5-Coder 0.5B and 1.5B (carried in <= 60 MB parts, reassembled and sha256-checked there), every method,
# 30 samples per cell (10 depths x 3), one model after another.
#   here:      bash packaging/device/issue25.sh stage       (issue24's stage, then the models' parts: .parts/NN/, a
#                                                            manifest in .kvmem/models.txt)
#   call 1:    bash packaging/device/issue25.sh start       (carry: [".whl", ".kvmem"]): the build starts in the background
#   calls 2..: bash packaging/device/issue25.sh take        (carry: [".parts/NN"], one part per call, ~5 s each, while
#                                                            the engine builds; the job waits for the last part)
#   then:      bash packaging/device/issue25.sh wait 540    (returns when a model's cells land, the job ends, or after
#                                                            540 s; issue the next call within the machine's 30 s idle window)
# env (call 1): EVALS (below), MODELS (qwen05 qwen15), SAMPLES (3 per depth), TIME_LIMIT (seconds per eval, 300)
# EVALS: `name|budgets|tasks|lengths` entries separated by ';', run for each model one after another (the default:
# 8 decoys at 1/8 at 16K and 32,600 tokens, the longest prompt the models' 32K training context takes with its
# answer; then 1/32 at 32,600 with the plain needle beside the decoys: 1/32 of 16K is below the engine's 640-token
# floor, which `kvmem eval` refuses before any server starts)
set -uo pipefail
EVALS=${EVALS:-"decoys|0,recency:1/8,hybrid:1/8,mass:1/8|niah_decoy8|16k,32600;small|0,hybrid:1/32,mass:1/32|niah_decoy8,niah_single_essay|32600"}
MODELS=${MODELS:-qwen05 qwen15}
SAMPLES=${SAMPLES:-3}
PART_BYTES=60000000
shipped_name() { case $1 in qwen05) echo "qwen2.5-coder:0.5b" ;; qwen15) echo "qwen2.5-coder:1.5b" ;; esac; }

case "${1:-}" in
stage)
  cd "$(dirname "$0")/../.."
  bash packaging/device/issue24.sh stage || exit 1
  rm -rf .parts && mkdir -p .parts
  : > .kvmem/models.txt
  n=0
  for key in qwen05 qwen15; do
    gguf=$(python3 -c "from kvmem_llama.shipped import shipped_model_path; print(shipped_model_path('$(shipped_name $key)'))") || exit 1
    sha=$(sha256sum "$gguf" | cut -d' ' -f1)
    split -b "$PART_BYTES" -d -a 2 "$gguf" ".parts/$key.gguf.part"
    parts=$(ls .parts/$key.gguf.part* | wc -l)
    for part in .parts/$key.gguf.part*; do  # one folder per call's carry
      dir=.parts/$(printf %02d $n); mkdir -p "$dir"; mv "$part" "$dir/"; n=$((n + 1))
    done
    echo "$key.gguf $sha $parts" >> .kvmem/models.txt
  done
  cat .kvmem/models.txt; echo "$n parts: calls 2..$((n + 1)) carry .parts/00 .. .parts/$(printf %02d $((n - 1)))" ;;
start)
  rm -rf /tmp/repo /tmp/out && mkdir -p /tmp/out /tmp/parts && cp -r . /tmp/repo
  cd /tmp/repo && EVALS=$EVALS MODELS=$MODELS SAMPLES=$SAMPLES TIME_LIMIT=${TIME_LIMIT:-300} \
    setsid nohup bash packaging/device/issue25.sh run >/tmp/out/run.log 2>&1 </dev/null &
  sleep 15; tail -n 5 /tmp/out/run.log ;;
take)
  mkdir -p /tmp/parts && cp .parts/*/* /tmp/parts/ && echo "$(ls /tmp/parts | wc -l) parts on this machine" ;;
assemble)  # PARTS_DIR (/tmp/parts) -> DEST (/tmp): each model of the manifest, checked; 3 when a part is missing
  parts_dir=${PARTS_DIR:-/tmp/parts}; dest=${DEST:-/tmp}
  while read -r name sha count; do
    have=$(ls "$parts_dir/$name".part* 2>/dev/null | wc -l)
    [ "$have" -eq "$count" ] || { echo "$name: $have of $count parts"; exit 3; }
    [ -f "$dest/$name" ] && [ "$(sha256sum "$dest/$name" | cut -d' ' -f1)" = "$sha" ] && continue
    cat "$parts_dir/$name".part* > "$dest/$name.tmp"
    got=$(sha256sum "$dest/$name.tmp" | cut -d' ' -f1)
    [ "$got" = "$sha" ] || { echo "$name: sha256 $got, expected $sha"; rm -f "$dest/$name.tmp"; exit 1; }
    mv "$dest/$name.tmp" "$dest/$name"; echo "$name: $count parts, sha256 ok"
  done < "${MANIFEST:-.kvmem/models.txt}" ;;
run)
  export OUT=/tmp/out
  . packaging/device/setup-env.sh
  export PATH=/tmp/site/bin:$PATH
  { nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv; nproc; } | tee "$OUT/host.txt"
  start=$(date +%s)
  kvmem build --sm 90 -j "$(nproc)" --fa-quants default --no-ui 2>&1 | tail -3
  echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/eval-notes.txt"
  deadline=$(( $(date +%s) + 1200 ))
  until bash packaging/device/issue25.sh assemble >>"$OUT/eval-notes.txt" 2>&1; do
    [ $? -eq 3 ] && [ "$(date +%s)" -lt "$deadline" ] || { echo "models not assembled" | tee -a "$OUT/eval-notes.txt"; exit 1; }
    sleep 5
  done
  for key in $MODELS; do
    IFS=';' read -ra evals <<< "$EVALS"
    for spec in "${evals[@]}"; do
      IFS='|' read -r name budgets tasks lengths <<< "$spec"
      mkdir -p "$OUT/$key-$name"
      OUT="$OUT/$key-$name" bash packaging/device/eval.sh "/tmp/$key.gguf" "/tmp/eval-$key-$name" \
        --budgets "$budgets" --tasks "$tasks" --lengths "$lengths" --depths spread10 --samples "$SAMPLES" --jobs 4
      echo "cell $key $name: done" | tee -a "$OUT/eval-notes.txt"
    done
  done
  echo "ALL DONE" ;;
wait)
  landed() { cat /tmp/out/eval-notes.txt 2>/dev/null | wc -l; }
  before=$(landed); deadline=$(( $(date +%s) + ${2:-540} ))
  while [ "$(date +%s)" -lt "$deadline" ] && [ "$(landed)" = "$before" ] && pgrep -f "issue25.sh run" >/dev/null; do
    sleep 5
  done
  # one tarball: a call brings back at most 8 files
  (cd /tmp/out && tar -czf "$OUT/results.tgz" --exclude=results.tgz . 2>/dev/null)
  tail -n "${LINES_BACK:-25}" /tmp/out/run.log; cat /tmp/out/eval-notes.txt 2>/dev/null ;;
*) echo "usage: $0 stage|start|take|assemble|wait [SECONDS]"; exit 2 ;;
esac
