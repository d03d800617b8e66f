# Sourced by the issue scripts: one background job per device session that survives the calls polling it.
#   job_start SCRIPT         copy the checkout to /tmp/repo and run `SCRIPT run` there in its own session
#   job_wait SCRIPT S FILES  until a line lands in FILES (under /tmp/out), the job ends, or S seconds pass
#   job_setup                in the job: $OUT, the carried wheels and kvmem installed, the source pack unpacked
#   job_build [--upstream]   in the job: our sm_90 engine (or the bare pin), timed; FA_QUANTS picks the flash-attention
#                            K/V pairs (default: upstream's set, the fastest build). Scripts run one after another on
#                            one warm machine share a build when they ask for the same pairs

job_start() {
  rm -rf /tmp/repo /tmp/out && mkdir -p /tmp/out && cp -r . /tmp/repo
  (cd /tmp/repo && setsid nohup bash "$1" run >/tmp/out/run.log 2>&1 </dev/null &)
  sleep 20; tail -n 20 /tmp/out/run.log
}

job_wait() {
  local script=$1 seconds=$2; shift 2
  local files=("${@/#//tmp/out/}")
  landed() { cat "${files[@]}" 2>/dev/null | wc -l; }
  local before deadline
  before=$(landed); deadline=$(( $(date +%s) + seconds ))
  while [ "$(date +%s)" -lt "$deadline" ] && [ "$(landed)" = "$before" ] && pgrep -f "$(basename "$script") run" >/dev/null; do
    sleep 5
  done
}

job_setup() {
  export OUT=/tmp/out
  . packaging/device/setup-env.sh
  export PATH=/tmp/site/bin:$PATH
}

job_build() {  # our sm_90 engine (no web UI), its time in host.txt
  local start
  start=$(date +%s)
  kvmem build --sm 90 -j "$(nproc)" --fa-quants "${FA_QUANTS:-default}" --no-ui "$@" 2>&1 | tail -3
  echo "build ${1:-ours}: $(( $(date +%s) - start )) s" | tee -a "$OUT/host.txt"
}
