"""The engine's C++ unit tests (patches/overlay/tests/test-kvmem-*.cpp), run through ctest in the CPU engine's build.

They check the tiering engine's pure parts without a model or a server: the phase machine of a sequence, the
residency rules (shares, protected blocks, the eviction order), the scorers and the lexical picks, the selection
plan, the undo journal, the host pool, the one check of the --kvmem-* settings, the graph scorer, its query
rows, the stager and the readback. `kvmem build` builds them with
the CPU engine (KVMEM_BUILD_TESTS=ON).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvmem_llama.engine import Engine

pytestmark = pytest.mark.engine

SUITES = {"seq", "residency", "score", "lexical", "plan", "journal", "pool", "disk", "params", "summaries", "queries",
          "stager", "readback"}


def test_engine_unit_tests_pass(cpu_engine: Engine) -> None:
    build = Path(cpu_engine.info.get("build_dir", ""))
    if not (build / "CTestTestfile.cmake").is_file():
        pytest.fail(f"the CPU engine {cpu_engine.key} has no build directory with its unit tests ({build}): "
                    "rebuild it with `kvmem build --force`")
    ctest = shutil.which("ctest")
    assert ctest, "ctest comes with cmake, which the CPU build needs"
    out = subprocess.run([ctest, "--test-dir", str(build), "-L", "kvmem", "--output-on-failure"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    ran = set(re.findall(r"Test\s+#\d+: kvmem-(\w+) \.+\s+Passed", out.stdout))
    assert ran == SUITES, out.stdout[-4000:]
