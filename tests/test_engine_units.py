"""The engine's C++ unit tests (patches/overlay/tests/test-kvmem-*.cpp), run through ctest in the CPU engine's build.

They check the tiering engine's pure parts without a model or a server: the phase machine of a sequence, the
residency rules (shares, protected blocks, the eviction order), the scorers and the lexical picks, the selection
plan, the undo journal, the host pool, the one check of the --kvmem-* settings, the graph scorer, its query
rows, the stager and the readback. One suite, `snapshot`, loads a model: the recurrent state snapshots of a hybrid
model (KVMEM_TEST_MODEL, here the tiny synthetic qwen35). `kvmem build` builds them with the CPU engine
(KVMEM_BUILD_TESTS=ON).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvmem_llama.engine import Engine

pytestmark = pytest.mark.engine

SUITES = {"seq", "residency", "score", "lexical", "plan", "journal", "pool", "disk", "params", "summaries", "queries",
          "stager", "readback", "snapshot"}


def test_engine_unit_tests_pass(cpu_engine: Engine, qwen35: dict[str, Path]) -> None:
    build = Path(cpu_engine.info.get("build_dir", ""))
    if not (build / "CTestTestfile.cmake").is_file():
        pytest.fail(f"the CPU engine {cpu_engine.key} has no build directory with its unit tests ({build}): "
                    "rebuild it with `kvmem build --force`")
    ctest = shutil.which("ctest")
    assert ctest, "ctest comes with cmake, which the CPU build needs"
    env = {**os.environ, "KVMEM_TEST_MODEL": str(qwen35["plain"])}
    out = subprocess.run([ctest, "--test-dir", str(build), "-L", "kvmem", "--output-on-failure"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    ran = set(re.findall(r"Test\s+#\d+: kvmem-(\w+) \.+\s+Passed", out.stdout))
    assert ran == SUITES, out.stdout[-4000:]


def test_the_snapshot_suite_reads_a_hybrid_models_recurrent_state(cpu_engine: Engine, qwen35: dict[str, Path]) -> None:
    """The suite checks nothing without a model: make sure it had one and took a snapshot of a real state."""
    exe = Path(cpu_engine.info.get("build_dir", "")) / "bin" / "test-kvmem"
    assert exe.is_file(), f"no test-kvmem in the CPU engine's build ({exe})"
    env = {**os.environ, "KVMEM_TEST_MODEL": str(qwen35["plain"])}
    env.pop("KVMEM_TEST_DEVICE", None)
    out = subprocess.run([str(exe), "snapshot"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    m = re.search(r"snapshot: (\d+) bytes, CPU", out.stderr)
    assert m and int(m.group(1)) > 0, out.stderr[-4000:]
