"""llama-server's web UI, built from the pinned tree's `tools/ui` with npm and embedded at build time.

`kvmem build` runs `npm ci` and the package's `build` script on a copy of `tools/ui` (the build
writes generated icons into its source dir, and the patched tree stays read-only), keeps only the
built `dist/` under the kvmem cache, keyed by the hash of every file of `tools/ui` (package.json and
package-lock.json included), and hands it to upstream's CMake (`LLAMA_BUILD_UI=ON`), which embeds
the files into llama-server. npm runs with the package's own .npmrc (ignore-scripts: no install
scripts of dependencies run). At run time nothing is fetched: the server serves the embedded files.
Without npm (or when npm fails) the engine is built without the UI and says why.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmem_llama import paths
from kvmem_llama.files import atomic_directory

UI_SUBDIR = "tools/ui"
# Never part of the source: npm's and the build's outputs if someone ran them in the tree.
# tests: not part of what is built, and not in a source pack (PACK_EXCLUDES), whose tree must find the same UI
_NOT_SOURCE = {"node_modules", "dist", ".svelte-kit", "build", "tests"}
# vite 7 (the pin's lockfile) refuses older Node.js; the package's .npmrc sets engine-strict.
MIN_NODE = (20, 19)
NPM_TIMEOUT_S = 1800


@dataclass(frozen=True)
class WebUI:
    """The outcome of providing the UI for one build: a built dist/, or why there is none."""

    source_hash: str | None
    dist: Path | None
    reason: str | None = None  # why the UI is not embedded
    cached: bool = False

    @property
    def available(self) -> bool:
        return self.dist is not None


def source_hash(ui_dir: Path) -> str:
    """sha256 over the relative path and bytes of every file of tools/ui (lockfile included)."""
    digest = hashlib.sha256()
    files = sorted(p for p in ui_dir.rglob("*")
                   if p.is_file() and not _NOT_SOURCE.intersection(p.relative_to(ui_dir).parts[:1]))
    for path in files:
        digest.update(path.relative_to(ui_dir).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def cache_root() -> Path:
    return paths.cache_dir() / "webui"


def cached_dist(digest: str) -> Path | None:
    dist = cache_root() / digest[:16] / "dist"
    return dist if (dist / "index.html").is_file() else None


def _version(cmd: list[str]) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else None


def npm_missing() -> str | None:
    """Why npm cannot build the UI here (None: it can): npm or a new enough Node.js is missing."""
    npm, node = shutil.which("npm"), shutil.which("node")
    if not npm or not node:
        missing = " and ".join(n for n, p in (("node", node), ("npm", npm)) if not p)
        return f"{missing} not found on PATH"
    version = _version([node, "--version"])
    if version is None or version[:2] < MIN_NODE:
        have = ".".join(map(str, version)) if version else "unknown"
        return f"Node.js {have} is too old (the UI's vite needs {MIN_NODE[0]}.{MIN_NODE[1]}+)"
    return None


def _run(cmd: list[str], cwd: Path, log_path: Path, env: dict[str, str]) -> int:
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}   (in {cwd})\n")
        log.flush()
        try:
            return subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=NPM_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            log.write(f"timed out after {NPM_TIMEOUT_S} s\n")
            return 124


def provide_ui(tree: Path, log: Callable[[str], None] = print) -> WebUI:
    """The built UI of `tree`/tools/ui: from the cache, else built with npm; never raises for npm trouble."""
    ui_dir = tree / UI_SUBDIR
    if not (ui_dir / "package.json").is_file() or not (ui_dir / "package-lock.json").is_file():
        return WebUI(None, None, f"the source tree has no {UI_SUBDIR}/package.json + package-lock.json")
    digest = source_hash(ui_dir)
    if (dist := cached_dist(digest)) is not None:
        return WebUI(digest, dist, cached=True)
    why = npm_missing()
    if why:
        return WebUI(digest, None, f"{why}; install Node.js {MIN_NODE[0]}.{MIN_NODE[1]}+ with npm and run "
                                   "`kvmem build` again to embed it")
    final = cache_root() / digest[:16]
    log_path = cache_root() / f"{digest[:16]}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("", encoding="utf-8")
    log(f"building the web UI with npm (tools/ui {digest[:12]}); log: {log_path}")
    env = {**os.environ, "npm_config_fund": "false", "npm_config_audit": "false", "npm_config_update_notifier": "false"}
    try:
        with atomic_directory(final, prefix=f".{digest[:16]}-") as staging:
            work = staging / "src"
            shutil.copytree(ui_dir, work, ignore=lambda d, names: _NOT_SOURCE & set(names) if Path(d) == ui_dir else ())
            env["LLAMA_UI_OUT_DIR"] = str(staging / "dist")
            for step in (["npm", "ci"], ["npm", "run", "build"]):
                code = _run(step, work, log_path, env)
                if code != 0:
                    raise _NpmFailed(f"`{' '.join(step)}` failed (exit {code}); log: {log_path}")
            if not (staging / "dist" / "index.html").is_file():
                raise _NpmFailed(f"`npm run build` left no dist/index.html; log: {log_path}")
            shutil.rmtree(work)  # node_modules is ~700 MB; npm's own cache keeps the tarballs
    except _NpmFailed as exc:
        return WebUI(digest, None, str(exc))
    return WebUI(digest, final / "dist")


class _NpmFailed(Exception):
    pass


def stage_for_cmake(ui: WebUI, build_dir: Path) -> None:
    """Put the built UI where upstream's scripts/ui-assets.cmake looks for npm output (or remove it).

    With LLAMA_BUILD_UI=ON that script skips npm when `<build>/tools/ui/dist/index.html` is newer
    than every UI source file, and embeds that dist. A dist left there from an earlier build is
    removed when the UI is off: the script would otherwise embed it as "stale assets".
    """
    ui_build = build_dir / UI_SUBDIR
    dist, marker = ui_build / "dist", ui_build / ".kvmem-ui-source"
    if ui.dist is None:
        shutil.rmtree(dist, ignore_errors=True)
        marker.unlink(missing_ok=True)
        return
    if marker.is_file() and marker.read_text().strip() == ui.source_hash and (dist / "index.html").is_file():
        return
    shutil.rmtree(dist, ignore_errors=True)
    ui_build.mkdir(parents=True, exist_ok=True)
    # shutil.copy gives fresh mtimes: newer than the sources, so CMake does not run npm itself
    shutil.copytree(ui.dist, dist, copy_function=shutil.copy)
    (ui_build / ".ui-stamp").unlink(missing_ok=True)  # the script's marker of downloaded assets
    marker.write_text(f"{ui.source_hash}\n")


def embedded_assets(build_dir: Path) -> int | None:
    """How many UI files the built server embeds, from the generated ui.h (None: not generated)."""
    header = build_dir / UI_SUBDIR / "ui.h"
    if not header.is_file():
        return None
    text = header.read_text(encoding="utf-8", errors="replace")
    if not re.search(r"#define\s+LLAMA_UI_HAS_ASSETS\s+1", text):
        return 0
    match = re.search(r"std::array<llama_ui_asset,\s*(\d+)>", text)
    return int(match.group(1)) if match else 0
