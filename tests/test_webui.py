"""The web UI: built with npm from the pinned tree's tools/ui and cached, embedded through upstream's own
CMake script, and used for real: headless Chromium chats with the CPU engine's llama-server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_build import path_without

from kvmem_llama import webui
from kvmem_llama.build import patched_tree
from kvmem_llama.engine import Engine
from kvmem_llama.patching import load_series
from kvmem_llama.vendor import load_pin

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
QUESTION = "Write one sentence about the Moon."
LOCK = {"name": "ui-test", "version": "1.0.0", "lockfileVersion": 3, "requires": True,
        "packages": {"": {"name": "ui-test", "version": "1.0.0"}}}


def _ui_source(root: Path, build_js: str) -> Path:
    """A tree with a tools/ui npm package (no dependencies) whose build script is `build_js`."""
    ui = root / "tools" / "ui"
    ui.mkdir(parents=True)
    (ui / "package.json").write_text(json.dumps({"name": "ui-test", "version": "1.0.0", "private": True,
                                                 "scripts": {"build": "node build.js"}}))
    (ui / "package-lock.json").write_text(json.dumps(LOCK))
    (ui / "build.js").write_text(build_js)
    return root


# like upstream's: it writes generated files into its own source dir, and the site into LLAMA_UI_OUT_DIR
BUILD_JS = """
const fs = require('fs');
fs.writeFileSync('static-generated.png', 'icon');
fs.mkdirSync(process.env.LLAMA_UI_OUT_DIR, {recursive: true});
fs.writeFileSync(process.env.LLAMA_UI_OUT_DIR + '/index.html', '<html>ui</html>');
"""


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_ui_is_built_once_then_cached_and_the_source_stays_untouched(cache, tmp_path, monkeypatch) -> None:
    tree = _ui_source(tmp_path / "tree", BUILD_JS)
    before = sorted(p.name for p in (tree / "tools/ui").iterdir())
    ui = webui.provide_ui(tree, log=lambda _: None)
    assert ui.available and not ui.cached, ui.reason
    assert (ui.dist / "index.html").read_text() == "<html>ui</html>"
    assert ui.dist.is_relative_to(cache / "webui")
    assert sorted(p.name for p in (tree / "tools/ui").iterdir()) == before  # built in a copy
    assert not list((cache / "webui").rglob("node_modules"))  # only dist/ is kept

    # the second time needs no npm at all
    monkeypatch.setenv("PATH", path_without("npm", tmp_path)["PATH"])
    again = webui.provide_ui(tree, log=lambda _: None)
    assert again.cached and again.dist == ui.dist

    # another lockfile is another UI: it must be built again, and without npm it says why
    (tree / "tools/ui/package-lock.json").write_text(json.dumps({**LOCK, "version": "1.0.1"}))
    other = webui.provide_ui(tree, log=lambda _: None)
    assert other.source_hash != ui.source_hash and not other.available
    assert "npm not found on PATH" in other.reason and "kvmem build" in other.reason


def test_a_failing_npm_build_skips_the_ui_with_its_log(cache, tmp_path) -> None:
    tree = _ui_source(tmp_path / "tree", "console.error('vite: boom'); process.exit(3);")
    ui = webui.provide_ui(tree, log=lambda _: None)
    assert not ui.available
    assert "`npm run build` failed (exit 3)" in ui.reason
    log = Path(ui.reason.rsplit("log: ", 1)[1])
    assert "vite: boom" in log.read_text()
    assert not list((cache / "webui").glob("*/dist"))  # nothing half-built is cached


def test_build_without_npm_says_the_ui_is_skipped_and_why(cache, tmp_path) -> None:
    env = path_without("npm", tmp_path)
    out = subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", "build", "--dry-run"], capture_output=True,
                         text=True, env={**env, "KVMEM_CACHE": str(cache)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "# web UI: skipped: npm not found on PATH; install Node.js 20.19+ with npm" in out.stdout
    assert "-DLLAMA_BUILD_UI=OFF" in out.stdout
    with_npm = subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", "build", "--dry-run"],
                              capture_output=True, text=True, timeout=120)  # KVMEM_CACHE: the fixture's
    assert "-DLLAMA_BUILD_UI=ON" in with_npm.stdout
    assert with_npm.stdout.split()[2] != out.stdout.split()[2]  # another engine key: both can be installed


def _run_ui_script(src: Path, build: Path, build_ui: bool) -> str:
    """Upstream's scripts/ui-assets.cmake with the arguments tools/ui/CMakeLists.txt gives it."""
    cmd = ["cmake", f"-DUI_SOURCE_DIR={src / 'tools/ui'}", f"-DUI_BINARY_DIR={build / 'tools/ui'}",
           f"-DLLAMA_SOURCE_DIR={src}", "-DLLAMA_BUILD_NUMBER=0", "-DHF_BUCKET=ggml-org/llama-ui", "-DHF_VERSION=",
           "-DHF_ENABLED=OFF", f"-DBUILD_UI={'ON' if build_ui else 'OFF'}", "-DLLAMA_UI_GZIP=ON",
           "-P", str(src / "scripts/ui-assets.cmake")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_staged_ui_is_what_upstreams_cmake_embeds(tmp_path) -> None:
    src = patched_tree(load_pin(), load_series(), log=lambda _: None)
    dist = tmp_path / "dist"
    for name in ("index.html", "manifest.webmanifest", "sw.js", "build.json", "_app/version.json",
                 "_app/immutable/bundle.abc.js", "_app/immutable/assets/bundle.abc.css", "workbox-1.js"):
        (dist / name).parent.mkdir(parents=True, exist_ok=True)
        (dist / name).write_text(f"/* {name} */")
    build = tmp_path / "build"
    webui.stage_for_cmake(webui.WebUI("f" * 64, dist), build)
    log = _run_ui_script(src, build, build_ui=True)
    assert "npm output up-to-date, skipping build" in log  # CMake did not run npm itself
    assert "UI: embedded 8 assets" in log
    assert webui.embedded_assets(build) == 8

    # the UI turned off: the staged files go, or the script would embed them as "stale assets"
    webui.stage_for_cmake(webui.WebUI(None, None, "npm not found"), build)
    log = _run_ui_script(src, build, build_ui=False)
    assert "stale" not in log and not (build / "tools/ui/dist").exists()
    assert webui.embedded_assets(build) == 0


@pytest.fixture
def chrome(tmp_path):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail("headless Chromium is missing: apt-get install chromium chromium-driver (.ci/run does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # no first-run, sync or component downloads: the page may reach nothing but the server
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,720", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.engine
@pytest.mark.slow
def test_chat_in_the_browser(cpu_engine: Engine, smollm2: Path, llama_server, chrome, tmp_path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    ui = cpu_engine.info.get("ui") or {}
    assert ui.get("embedded"), f"the CPU engine has no web UI ({ui.get('skipped')}): run `kvmem build` with npm"
    # greedy defaults: the UI takes its sampling settings from the server's /props
    with llama_server(smollm2, ["-c", "2048", "--temp", "0", "-n", "40"]) as srv:
        chrome.get(srv.url + "/")
        wait = WebDriverWait(chrome, 180)
        box = wait.until(lambda d: d.find_elements(By.TAG_NAME, "textarea"))[0]
        box.send_keys(QUESTION)
        box.send_keys(Keys.ENTER)
        assistant = '[aria-label="Assistant message with actions"] .markdown-content'
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, assistant)
                   and not d.find_elements(By.CSS_SELECTOR, '[aria-label="Stop generation"]'))
        shown = chrome.find_elements(By.CSS_SELECTOR, assistant)[-1].text
        chrome.save_screenshot(str(tmp_path / "webui-chat.png"))
        # the page shows the model's own answer: the same greedy answer the API gives
        api = httpx.post(srv.url + "/v1/chat/completions", timeout=180,
                         json={"messages": [{"role": "user", "content": QUESTION}]}).json()
        answer = api["choices"][0]["message"]["content"]
        assert shown.strip() and " ".join(shown.split()) == " ".join(answer.split())
        assert QUESTION in chrome.find_element(By.TAG_NAME, "body").text
