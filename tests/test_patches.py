"""The patch series: strict application, overlay, hash, and the edit/export loop."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvmem_llama import __version__, paths
from kvmem_llama.errors import PatchError
from kvmem_llama.patches import PATCHES_DIR
from kvmem_llama.patching import apply_series, create_edit_tree, export_edit_tree, load_series
from kvmem_llama.vendor import load_pin

UPSTREAM_FILE = "src/engine.c"
UPSTREAM_TEXT = "".join(f"line {i}\n" for i in range(1, 31))


def write_series(root: Path, patches: dict[str, str], overlay: dict[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "series").write_text("# test series\n" + "".join(f"{n}\n" for n in patches))
    for name, text in patches.items():
        (root / name).write_text(text)
    for rel, text in (overlay or {}).items():
        target = root / "overlay" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def fake_upstream(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / UPSTREAM_FILE).write_text(UPSTREAM_TEXT)
    return root


GOOD_PATCH = """Subject: change two lines

---
diff --git a/src/engine.c b/src/engine.c
--- a/src/engine.c
+++ b/src/engine.c
@@ -2,3 +2,3 @@
 line 2
-line 3
+line three
 line 4
@@ -20,3 +20,4 @@
 line 20
 line 21
+#include "ours.h"
 line 22
"""

BROKEN_PATCH = """Subject: expects text that is not there
---
--- a/src/engine.c
+++ b/src/engine.c
@@ -5,3 +5,3 @@
 line 5
-line 6
+line six
 line 7
@@ -10,3 +10,3 @@
 line 10
-line eleven
+line 11 changed
 line 12
"""


def test_good_series_applies_with_overlay(tmp_path: Path) -> None:
    patches = {"0001-good.patch": GOOD_PATCH}
    series = load_series(write_series(tmp_path / "p", patches, {"src/ours.h": "#pragma once\n"}))
    tree = fake_upstream(tmp_path / "tree")
    apply_series(tree, series)
    text = (tree / UPSTREAM_FILE).read_text().splitlines()
    assert text[2] == "line three"
    assert text[21] == '#include "ours.h"' and text[22] == "line 22"
    assert (tree / "src/ours.h").read_text() == "#pragma once\n"


def test_broken_patch_names_file_and_hunk(tmp_path: Path) -> None:
    patches = {"0001-good.patch": GOOD_PATCH, "0002-broken.patch": BROKEN_PATCH}
    series = load_series(write_series(tmp_path / "p", patches))
    tree = fake_upstream(tmp_path / "tree")
    with pytest.raises(PatchError) as err:
        apply_series(tree, series)
    message = str(err.value)
    assert "0002-broken.patch" in message
    assert "hunk #2" in message and "@@ -10,3 +10,3 @@" in message
    assert "src/engine.c" in message and "line eleven" in message


def test_patch_creating_an_existing_file_is_refused(tmp_path: Path) -> None:
    patch = "--- /dev/null\n+++ b/src/engine.c\n@@ -0,0 +1 @@\n+new\n"
    series = load_series(write_series(tmp_path / "p", {"0001-new.patch": patch}))
    with pytest.raises(PatchError, match="already exists"):
        apply_series(fake_upstream(tmp_path / "tree"), series)


def test_series_hash_covers_patches_and_overlay(tmp_path: Path) -> None:
    root = write_series(tmp_path / "p", {"0001-good.patch": GOOD_PATCH}, {"src/ours.h": "a\n"})
    first = load_series(root).hash()
    (root / "overlay/src/ours.h").write_text("b\n")
    second = load_series(root).hash()
    (root / "0001-good.patch").write_text(GOOD_PATCH.replace("line three", "line 3!"))
    third = load_series(root).hash()
    assert len({first, second, third}) == 3


def test_a_series_keeps_the_hash_it_first_computed(tmp_path: Path) -> None:
    """A build keys its tree, build dir and engine by one series object's hash from start to end: an overlay file
    saved while it compiles must not move it to another tree's build dir halfway (that once failed a build with
    "the server embeds no UI files" and could have installed an engine under the edited series' key)."""
    root = write_series(tmp_path / "p", {"0001-good.patch": GOOD_PATCH}, {"src/ours.h": "a\n"})
    series = load_series(root)
    before = series.hash()
    (root / "overlay/src/ours.h").write_text("b\n")
    assert series.hash() == before != load_series(root).hash()


def test_series_lists_only_existing_patch_files(tmp_path: Path) -> None:
    root = write_series(tmp_path / "p", {"0001-good.patch": GOOD_PATCH})
    (root / "series").write_text("0001-good.patch\n0002-missing.patch\n")
    with pytest.raises(PatchError, match="0002-missing.patch, which does not exist"):
        load_series(root)


def test_edit_then_export_round_trip(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.fail("git is required for the maintainer loop")
    series = load_series(write_series(tmp_path / "p", {"0001-good.patch": GOOD_PATCH}, {"src/ours.h": "v1\n"}))
    upstream = fake_upstream(tmp_path / "upstream")
    (upstream / ".git").write_text("gitdir: ../.git/modules/llama.cpp\n")  # as the pinned sdist ships it
    work = tmp_path / "work"
    create_edit_tree(upstream, series, work, "fake upstream")
    log = subprocess.run(["git", "-C", str(work), "log", "--format=%s"], capture_output=True, text=True).stdout
    assert log.splitlines() == ["change two lines", "kvmem overlay: whole files of ours (patches/overlay)",
                                "upstream: fake upstream"]
    # a maintainer edits an upstream file, changes an overlay file and adds a new file of ours
    engine = work / UPSTREAM_FILE
    engine.write_text(engine.read_text().replace("line 29\n", "line 29\n// kvmem hook\n"))
    (work / "src/ours.h").write_text("v2\n")
    (work / "src/llama-new.cpp").write_text("// ours\n")
    subprocess.run(["git", "-C", str(work), "commit", "-qam", "Add a hook", "--no-verify"], check=True)
    subprocess.run(["git", "-C", str(work), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(work), "commit", "-qm", "Add new file", "--no-verify"], check=True)

    out = tmp_path / "exported"
    exported = export_edit_tree(work, out)
    assert exported.names == ["0001-change-two-lines.patch", "0002-add-a-hook.patch"]
    assert [p.as_posix() for p in exported.overlay_files()] == ["src/llama-new.cpp", "src/ours.h"]
    rebuilt = fake_upstream(tmp_path / "rebuilt")
    apply_series(rebuilt, exported)
    for rel in (UPSTREAM_FILE, "src/ours.h", "src/llama-new.cpp"):
        assert (rebuilt / rel).read_text() == (work / rel).read_text()


def test_export_refuses_uncommitted_changes(tmp_path: Path) -> None:
    series = load_series(write_series(tmp_path / "p", {"0001-good.patch": GOOD_PATCH}))
    work = tmp_path / "work"
    create_edit_tree(fake_upstream(tmp_path / "upstream"), series, work, "fake")
    (work / UPSTREAM_FILE).write_text("dirty\n")
    with pytest.raises(Exception, match="uncommitted changes"):
        export_edit_tree(work, tmp_path / "out")


def test_overlay_version_matches_the_package() -> None:
    header = (PATCHES_DIR / "overlay/common/kvmem-version.h").read_text()
    assert re.search(r'#define KVMEM_LLAMA_VERSION "([^"]+)"', header).group(1) == __version__


@pytest.mark.engine
def test_real_series_applies_to_the_pinned_tree(tmp_path: Path) -> None:
    """Our committed series applies cleanly to the verified upstream tree (cached by the build)."""
    upstream = paths.cache_dir() / "upstream" / load_pin().short
    if not upstream.is_dir():
        pytest.fail(f"{upstream} is missing: run `kvmem build` (or `kvmem vendor fetch`) first")
    series = load_series()
    tree = tmp_path / "tree"
    tree.mkdir()
    for rel in {p.split("/")[0] for p in _touched_files(series)} | {"common"}:
        if (upstream / rel).is_dir():
            shutil.copytree(upstream / rel, tree / rel, dirs_exist_ok=True)
        elif (upstream / rel).is_file():  # a top-level file such as CMakeLists.txt
            shutil.copy2(upstream / rel, tree / rel)
    apply_series(tree, series)
    assert "kvmem" in (tree / "common/build-info.cpp.in").read_text()


def _touched_files(series) -> list[str]:
    touched = []
    for name in series.names:
        for line in (series.directory / name).read_text().splitlines():
            if line.startswith("+++ b/"):
                touched.append(line[6:])
    return touched + [p.as_posix() for p in series.overlay_files()]
