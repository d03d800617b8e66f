#!/usr/bin/env bash
# On the GPU host, after build-sm90.sh or build-ab.sh (same warm machine: the engine is in the store):
# one `kvmem eval --run` with its servers on the GPU, then the report. What a device call brings back
# is copied to $OUT at the end, also when the run is cut short (the same call again resumes it):
# results.jsonl, summary.md, summary.json and eval-logs.tar.gz (server logs, runs.json, PNGs).
#   eval.sh MODEL EVAL_DIR [kvmem eval arguments...]
#   eval.sh /tmp/m.gguf /tmp/eval --budgets 0,retrieval:1/8,recency:1/8 --tasks niah_single_essay,followup \
#       --lengths 8k,32k --depths spread10 --samples 3 --jobs 3
# env: ENGINE       an engine folder (of any store) or a key of `kvmem engines`; default: the one for this GPU
#      SERVER_ARGS  flags for every server (default "-ngl 99 -t 4": 16 cores for up to 4 servers at once)
#      TIME_LIMIT   seconds of evaluation before it is interrupted, results kept (default 540: a 10-min call)
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/kv:/tmp/site PATH=/tmp/kv/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
command -v kvmem >/dev/null || . packaging/device/setup-env.sh
[ $# -ge 2 ] || { echo "usage: eval.sh MODEL EVAL_DIR [kvmem eval arguments...]"; exit 2; }
MODEL=$1; DIR=$2; shift 2
engine=()
if [ -n "${ENGINE:-}" ]; then
  if [ -d "$ENGINE" ]; then  # a folder: its store becomes kvmem's home, its name the key
    KVMEM_HOME=$(dirname "$(dirname "$(realpath "$ENGINE")")"); export KVMEM_HOME
    ENGINE=$(basename "$ENGINE")
  fi
  engine=(--engine "$ENGINE")
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/eval-notes.txt"
start=$(date +%s)
# SIGINT is Ctrl-C for kvmem eval: servers stopped, every answered sample kept, the report drawn
timeout -s INT -k 60 "${TIME_LIMIT:-540}" \
  kvmem eval --run "$MODEL" "${engine[@]}" --server-args "${SERVER_ARGS:--ngl 99 -t 4}" --out "$DIR" "$@"
rc=$?
n=0; [ -f "$DIR/results.jsonl" ] && n=$(wc -l < "$DIR/results.jsonl")
echo "kvmem eval $*: exit $rc after $(( $(date +%s) - start )) s, $n results" | tee -a "$OUT/eval-notes.txt"
if [ -f "$DIR/results.jsonl" ]; then
  kvmem eval report "$DIR" >/dev/null
  cp "$DIR/results.jsonl" "$DIR/summary.md" "$DIR/summary.json" "$OUT/"
  tar -czf "$OUT/eval-logs.tar.gz" -C "$DIR" logs runs.json accuracy_vs_length.png depth_heatmap.png
  cat "$DIR/summary.md"
fi
exit $rc
