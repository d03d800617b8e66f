"""Launching servers (kvmem_llama.serving) with the real CPU engine and SmolLM2: argv layering,
readiness and the tiering self-test, the registry, the CLI lifecycle (run, ps, logs, stop, serve).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from test_scale_rpc import rpc_server

from kvmem_llama import hardware, kvmem_log, planner
from kvmem_llama.engine import Engine, build_sm_flag, check_engine_for_gpu, list_engines, select_engine
from kvmem_llama.errors import KvmemError
from kvmem_llama.serving import argv, launch, readiness, registry
from kvmem_llama.serving.process import ServerFailed
from kvmem_llama.shipped import shipped_model_path

SELECT = ("srv  kvmem_score: SELECT seq=0 n_blocks=96 budget_blocks=16 sink=1 recent=4 scored=11 staged_in=11 "
          "staged_out=3 reused=2 query_tokens=21 ms=0.41")
ARMED = "kvmem_score: ARMED blocks=96 block_tokens=128 layers=30 kv_heads=3 head_dim=64 budget_blocks=16"


@pytest.fixture(autouse=True)
def servers_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "servers"
    monkeypatch.setenv("KVMEM_SERVERS_DIR", str(folder))
    return folder


def kvmem() -> list[str]:
    return [sys.executable, "-m", "kvmem_llama.cli.main"]


def cpu_hw() -> hardware.Hardware:
    return hardware.detect(vram="0")


# --- log lines and argv (no server) ---


def test_kvmem_log_parsing() -> None:
    sel = kvmem_log.parse_select(SELECT)
    assert sel is not None and sel["n_blocks"] == 96 and sel["staged_in"] == 11 and sel["ms"] == pytest.approx(0.41)
    assert kvmem_log.parse_armed(ARMED)["budget_blocks"] == 16
    assert kvmem_log.parse_disabled("kvmem_score: DISABLED (budget >= n_ctx)") == {
        "event": "DISABLED", "reason": "budget >= n_ctx"}
    assert kvmem_log.parse_select(SELECT.replace(" ms=0.41", "")) is None  # a documented key missing
    assert kvmem_log.parse_line("srv  load_model: loading model") is None
    text = "\n".join(["x", ARMED, SELECT, "y"])
    assert [e["event"] for e in kvmem_log.iter_events(text)] == ["ARMED", "SELECT"]
    assert kvmem_log.tiering_state(text) == "armed"
    assert kvmem_log.tiering_state("kvmem_score: DISABLED (no attention layers)") == "disabled: no attention layers"


def test_kvmem_log_parses_follow_draft_and_the_select_extras() -> None:
    follow = "W kvmem_score: FOLLOW seq=3 n_blocks=45 staged_in=4 staged_out=6 resident=7 target_resident=7 common=7"
    draft = "W kvmem_score: DRAFT follows the target's selection: blocks=65 layers=1 host_mib=5"
    select = SELECT.replace(" ms=0.41", " ms=0.41 stage_ms=0.120 stage_mib=11.0")
    text = "\n".join([ARMED, draft, select, follow])
    assert [e["event"] for e in kvmem_log.iter_events(text)] == ["ARMED", "DRAFT", "SELECT", "FOLLOW"]
    assert kvmem_log.follows(text) == [kvmem_log.parse_follow(follow)]
    assert kvmem_log.parse_follow(follow)["common"] == 7
    assert kvmem_log.parse_follow(follow.replace(" common=7", "")) is None
    assert kvmem_log.parse_line(draft) == {"event": "DRAFT", "blocks": 65, "layers": 1, "host_mib": 5}
    assert kvmem_log.parse_select(select)["stage_mib"] == 11.0
    assert kvmem_log.tiering_state(text) == "armed"


def test_self_test_prompt_is_the_same_for_the_same_budget() -> None:
    assert readiness.self_test_prompt(640) == readiness.self_test_prompt(640)
    assert readiness.self_test_prompt(640)[1] != readiness.self_test_prompt(641)[1]  # the budget is the seed


def test_self_test_check_on_log_text() -> None:
    prompt, code = readiness.self_test_prompt(2048, seed=1)
    assert f"vault code is {code}" in prompt and len(prompt.split()) > 2048  # longer than the budget
    ok, why = readiness.check_self_test(f"The code is {code}.", code, f"{ARMED}\n{SELECT}")
    assert ok and "n_blocks=96" in why
    ok, why = readiness.check_self_test(f"{code}", code, ARMED)
    assert not ok and "SELECT" in why
    ok, why = readiness.check_self_test("1234", code if code != "1234" else "4321", SELECT)
    assert not ok and "does not contain the needle" in why
    ok, why = readiness.check_self_test(code, code, "kvmem_score: DISABLED (model has no attention layers)")
    assert not ok and "turned tiering off" in why


def test_merge_args_user_flags_win() -> None:
    plan = ["-c", "8192", "-ctk", "f16", "-m", "a.gguf", "--strict-model-id"]
    profile = ["--temp", "0.7", "--top-k", "20"]
    user = ["--ctx-size=4096", "--temperature", "0.1", "--parallel", "2", "--some-new-flag", "-5"]
    merged = argv.merge_args(plan, profile, user)
    assert merged == ["-ctk", "f16", "-m", "a.gguf", "--strict-model-id", "--top-k", "20",
                      "--ctx-size=4096", "--temperature", "0.1", "--parallel", "2", "--some-new-flag", "-5"]
    assert argv.user_flags(["-a", "x,y", "--port", "9000", "--strict-model-id"]) == {
        "-a": "x,y", "--port": "9000", "--strict-model-id": None}


def test_scan_flags_reads_every_spelling_once() -> None:
    args = ["-np", "4", "--ctx-size=8192", "--strict-model-id", "x", "--api-key", "-k3y", "--temp", "-0.5", "-c"]
    assert [(use.flag, use.value) for use in argv.scan_flags(args)] == [
        ("--parallel", "4"), ("-c", "8192"), ("--strict-model-id", None),  # a switch takes no value
        ("--api-key", "-k3y"), ("-k3y", None),  # a key may begin with "-", as llama-server reads it
        ("--temp", "-0.5"), ("-c", None)]  # a negative number is a value; nothing after the last flag
    assert argv.api_key_from(args, env={}) == "-k3y" and argv.slot_context(8192, args) == 2048


def test_profile_args_tiering_paths(cpu_engine: Engine) -> None:
    help_text = argv.engine_help(cpu_engine)
    assert argv.supports(help_text, "--ctx-size") and argv.supports(help_text, "-ctk")
    assert not argv.supports(help_text, "--no-such-flag-anywhere")
    fake_help = help_text + "\n--kvmem-budget N   tokens on GPU\n--kvmem-host-mib N  pool\n"
    prof = planner.Profile("gpu", 262144, 43776, 4096, 128, "q5_0", "q5_0", 16384, True, None)
    on = argv.profile_args(prof, fake_help, tiering=True, has_gpu=True)
    assert on[on.index("--kvmem-budget") + 1] == "43776" and on[on.index("--kvmem-host-mib") + 1] == "16384"
    assert on[on.index("--kvmem-gen-reserve") + 1] == "4096" and on[on.index("-fa") + 1] == "on"
    assert on[on.index("-ngl") + 1] == "999" and on[on.index("--spec-type") + 1] == "draft-mtp"
    off = argv.profile_args(prof, help_text, tiering=False, has_gpu=False)
    assert not any(a.startswith("--kvmem") for a in off) and "-ngl" not in off
    assert argv.sampling_args("tool") == ["--temp", "0.2", "--top-p", "0.8", "--top-k", "20",
                                              "--presence-penalty", "0.05"]
    with pytest.raises(KvmemError):
        argv.sampling_args("creative")


def test_decide_tiering(cpu_engine: Engine) -> None:
    real_help = tiering_help = argv.engine_help(cpu_engine)
    prof = planner.Profile("gpu", 262144, 43776, 4096, 128, "f16", "f16", 16384, False, None)
    on = argv.decide_tiering(prof, tiering_help, {})
    assert on == (prof, True, 43776, [])
    assert argv.supports(real_help, "--kvmem-budget")  # our engine tiers; an upstream one does not:
    upstream_help = "\n".join(line for line in real_help.splitlines() if "--kvmem" not in line)
    shrunk, tiering, budget, notes = argv.decide_tiering(prof, upstream_help, {})  # the context shrinks to fit
    assert (shrunk.ctx, shrunk.budget, tiering, budget) == (43776 + 4096, 0, False, 0)
    assert "context lowered from 262144 to 47872" in notes[0]
    assert argv.decide_tiering(prof, tiering_help, {"--kvmem-budget": "0"})[1:3] == (False, 0)
    cpu = planner.Profile("cpu", 8192, 0, 0, 128, "f16", "f16", 0, False, None)
    assert argv.decide_tiering(cpu, tiering_help, {"--kvmem-budget": "2048"})[1:3] == (True, 2048)


def test_self_test_against_a_real_server(smollm2: Path) -> None:
    """The needle request really runs; an engine that logs no SELECT line fails the self-test."""
    lp = launch.prepare(None, extra_args=["-c", "2048"], port="auto", hw=cpu_hw())
    lp = dataclasses.replace(lp, budget=128, tiering=True, self_test=True)
    handle = launch.launch(lp, name="selftest")
    try:
        with pytest.raises(ServerFailed, match="no `kvmem_score: SELECT` line") as err:
            handle.wait_ready(120, expect_ctx=2048, self_test=True)
        assert "last lines of" in str(err.value)
        assert "prompt eval time" in handle.log_text()  # the needle prompt was processed
    finally:
        handle.stop()


def test_engine_selection_by_sm(cpu_engine: Engine) -> None:
    gpu_hw = hardware.Hardware([hardware.GPU(0, "NVIDIA GeForce RTX 4090", "89", 24 << 30, 24 << 30)], 1, 1)
    assert select_engine(cpu_hw()).key == cpu_engine.key
    assert select_engine(gpu_hw, "cpu").key == cpu_engine.key
    if not any(e.sms and e.runs_on("89") for e in list_engines()):
        with pytest.raises(KvmemError) as err:
            select_engine(gpu_hw)
        assert err.value.hint.startswith("kvmem build --sm 89")
    sm89 = Engine(cpu_engine.path, {**cpu_engine.info, "sms": ["89"], "target": "cuda-sm89"})
    ampere = hardware.Hardware([hardware.GPU(0, "NVIDIA GeForce RTX 3090", "86", 24 << 30, 24 << 30)], 1, 1)
    with pytest.raises(KvmemError, match="no kernel image"):
        check_engine_for_gpu(sm89, ampere)  # 8.9 code does not run on an older minor
    check_engine_for_gpu(Engine(cpu_engine.path, {"sms": ["86"]}), gpu_hw)  # 8.6 code runs on 8.9
    blackwell = hardware.Hardware([hardware.GPU(0, "RTX 5060 Ti", "120", 16 << 30, 16 << 30)], 1, 1)
    check_engine_for_gpu(Engine(cpu_engine.path, {"sms": ["120a"]}), blackwell)  # 120a runs on 12.0
    assert build_sm_flag("120") == "120"
    with pytest.raises(KvmemError, match="no NVIDIA GPU"):
        select_engine(cpu_hw(), "gpu")


def test_dry_run_layers_and_detection(cpu_engine: Engine) -> None:
    lp = launch.prepare(None, extra_args=["-c", "1024", "--alias", "tiny", "--n-predict", "7"], port="auto",
                          mode="tool", hw=cpu_hw())
    command = lp.argv
    assert command[0] == str(cpu_engine.server)
    assert command.count("-c") + command.count("--ctx-size") == 1 and command[command.index("-c") + 1] == "1024"
    assert lp.model_id == "tiny" and lp.ctx == 1024 and "--alias" in command and command.count("--alias") == 1
    assert command[command.index("--temp") + 1] == "0.2" and command[command.index("--n-predict") + 1] == "7"
    assert not lp.tiering and not any(a.startswith("--kvmem") for a in command)  # a CPU plan: the whole KV fits
    help_text = argv.engine_help(cpu_engine)
    assert ("--strict-model-id" in command) == argv.supports(help_text, "--strict-model-id")


def test_a_capped_host_pool_gets_a_disk_tier_under_the_store(cpu_engine: Engine, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert argv.disk_tier_args(0, tmp_path, 10 * 2**40) == ([], "")  # a pool sized for the context never fills
    flags, note = argv.disk_tier_args(6144, tmp_path, 10 * 2**40)
    assert flags == ["--kvmem-disk-path", str(tmp_path), "--kvmem-disk-mib", "12288"] and note == ""
    assert argv.disk_tier_args(6144, tmp_path, 4 * 2**30)[0][-1] == "2048"  # at most half the free space
    flags, note = argv.disk_tier_args(6144, tmp_path, 2**30)
    assert flags == [] and "no disk tier" in note and "1.0 GiB free" in note
    monkeypatch.setenv("KVMEM_KV_DISK_DIR", str(tmp_path / "kv"))
    lp = launch.prepare(None, extra_args=["-c", "4096", "--kvmem-budget", "1024", "--kvmem-host-mib", "600"],
                        port="auto", hw=cpu_hw())
    free = shutil.disk_usage(tmp_path).free
    expected = argv.disk_tier_args(600, tmp_path / "kv", free)
    assert lp.tiering and (tmp_path / "kv").is_dir()
    command = lp.argv
    if expected[0]:
        assert command[command.index("--kvmem-disk-path") + 1] == str(tmp_path / "kv")
        assert command[command.index("--kvmem-disk-mib") + 1] == expected[0][-1]
    else:
        assert "--kvmem-disk-path" not in command and expected[1] in lp.notes
    user = launch.prepare(None, extra_args=["-c", "4096", "--kvmem-budget", "1024", "--kvmem-host-mib", "600",
                                            "--kvmem-disk-mib", "1100"], port="auto", hw=cpu_hw()).argv
    assert user.count("--kvmem-disk-mib") == 1 and user[user.index("--kvmem-disk-mib") + 1] == "1100"


# --- real servers ---


def test_tiering_self_test_passes_on_the_real_engine(smollm2: Path, servers_dir: Path) -> None:
    """With the tiering engine, a user budget arms tiering and readiness waits for a found needle + SELECT."""
    with launch.start_server(None, ctx=8192, extra_args=["--kvmem-budget", "1024", "-t", "2"], hw=cpu_hw()) as srv:
        log = srv.log_text()
        assert any(kvmem_log.parse_armed(line) for line in log.splitlines())
        selects = [s for line in log.splitlines() if (s := kvmem_log.parse_select(line))]
        assert selects and selects[-1]["budget_blocks"] == 1024 // 128
        assert httpx.get(f"{srv.url}/props", timeout=10).json()["kvmem"]["budget"] == 1024


def test_tiering_disabled_by_the_engine_fails_readiness_with_the_reason(servers_dir: Path) -> None:
    """gemma3 (sliding window) is not tiered: an untiered fallback would need the whole context in VRAM."""
    gemma = shipped_model_path("gemma3:270m")
    with pytest.raises(ServerFailed, match=r"disabled KV tiering \(.+\).*lower the context"):
        launch.start_server(str(gemma), ctx=4096, extra_args=["--kvmem-budget", "1024", "-t", "2"], hw=cpu_hw())


def test_start_server_ready_and_stop(smollm2: Path, servers_dir: Path) -> None:
    with launch.start_server(None, ctx=2048, mode="tool", extra_args=["-t", "2"]) as srv:
        assert srv.model_id == "smollm2" and srv.ctx == 2048
        models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "smollm2" and models["data"][0]["meta"]["n_ctx"] == 2048
        props = httpx.get(f"{srv.url}/props", timeout=10).json()["default_generation_settings"]["params"]
        assert props["temperature"] == pytest.approx(0.2) and props["top_k"] == 20
        assert props["presence_penalty"] == pytest.approx(0.05)
        record = registry.load(srv.name)
        assert record is not None and record.pid == srv.pid and record.alive and not record.detached
        assert srv.log_path.parent == servers_dir and "listening on" in srv.log_text()
        pid = srv.pid
    assert srv.returncode() is not None and not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    assert registry.load(srv.name) is None  # record dropped on stop


def test_port_in_use_is_a_clear_error(smollm2: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(KvmemError, match=f"port {port} on 127.0.0.1 is already in use") as err:
            launch.prepare(None, port=port, hw=cpu_hw())
        assert "--port auto" in err.value.hint


def test_crash_reports_exit_code_and_log(smollm2: Path) -> None:
    with pytest.raises(ServerFailed) as err:
        launch.start_server(None, extra_args=["--no-such-llama-flag"], ready_timeout=60)
    text = str(err.value)
    assert "exited with code" in text and "--no-such-llama-flag" in text and "last lines of" in text


def test_ready_timeout_shows_log(smollm2: Path) -> None:
    with pytest.raises(ServerFailed, match="not ready") as err:
        launch.start_server(None, ctx=1024, ready_timeout=0.01)
    assert "last lines of" in str(err.value)
    assert not [r for r in registry.list_records() if r.alive]  # the server was stopped


def _read_lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def test_cli_foreground_ctrl_c(smollm2: Path, servers_dir: Path) -> None:
    env = {**os.environ, "KVMEM_SERVERS_DIR": str(servers_dir)}
    script = ("import faulthandler, runpy, signal, sys\n"
              "faulthandler.register(signal.SIGUSR1, all_threads=True)  # stack dump if it ever hangs\n"
              "sys.argv = ['kvmem', 'run', '--port', 'auto', '--name', 'fg', '--', '-c', '1024']\n"
              f"runpy.run_module({kvmem()[-1]!r}, run_name='__main__')\n")
    proc = subprocess.Popen([sys.executable, "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            line = lines.get(timeout=120)
            if line is None:
                break
            seen.append(line)
            if line.startswith("ready "):
                break
        assert any(line.startswith("ready http://127.0.0.1:") for line in seen), "".join(seen)
        echo_deadline = time.monotonic() + 15  # the log echo runs in its own thread and may trail "ready"
        while not any("listening on" in line for line in seen) and time.monotonic() < echo_deadline:
            try:
                seen.append(lines.get(timeout=1) or "")
            except queue.Empty:
                pass
        assert any("listening on" in line for line in seen)  # the server log is echoed to the console
        record = registry.load("fg")
        assert record is not None and record.alive
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # faulthandler: where is it stuck?
            time.sleep(2)
            rest = []
            while not lines.empty():
                rest.append(lines.get() or "")
            pytest.fail("kvmem run ignored Ctrl-C:\n" + "".join(seen[-10:] + rest))
        assert code == 0
        assert not record.alive
        assert registry.load("fg") is None
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_detach_ps_logs_stop(smollm2: Path, servers_dir: Path) -> None:
    env = {**os.environ, "KVMEM_SERVERS_DIR": str(servers_dir)}
    out = subprocess.run([*kvmem(), "run", "--detach", "--name", "bg", "--port", "auto", "--", "-c", "1024"],
                         capture_output=True, text=True, env=env, timeout=180)
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "ready http://127.0.0.1:" in out.stdout and "detached as bg" in out.stdout
        record = registry.load("bg")
        assert record is not None and record.alive and record.detached and record.ctx == 1024
        assert os.getsid(record.pid) == record.pid  # its own session: survives the terminal
        ps = subprocess.run([*kvmem(), "ps", "--json"], capture_output=True, text=True, env=env, timeout=60)
        rows = json.loads(ps.stdout)
        assert [(r["name"], r["pid"], r["alive"], r["model"]) for r in rows] == [("bg", record.pid, True, "smollm2")]
        assert rows[0]["rss"] > 10 << 20 and rows[0]["uptime_s"] >= 0
        table = subprocess.run([*kvmem(), "ps"], capture_output=True, text=True, env=env, timeout=60)
        assert "bg" in table.stdout and str(record.port) in table.stdout
        logs = subprocess.run([*kvmem(), "logs", "bg", "-n", "500"], capture_output=True, text=True, env=env,
                              timeout=60)
        assert "listening on" in logs.stdout
        stop = subprocess.run([*kvmem(), "stop", "bg"], capture_output=True, text=True, env=env, timeout=60)
        assert stop.returncode == 0 and "bg: stopped" in stop.stdout
        assert not record.alive and registry.load("bg") is None
        again = subprocess.run([*kvmem(), "stop", "bg"], capture_output=True, text=True, env=env, timeout=60)
        assert again.returncode != 0 and "no server named 'bg'" in again.stderr
    finally:
        if (rec := registry.load("bg")) is not None:
            registry.stop(rec, 5)


def test_serve_is_a_drop_in(smollm2: Path) -> None:
    helped = subprocess.run([*kvmem(), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0
    assert "--ctx-size" in helped.stdout and "--cache-type-k" in helped.stdout  # llama-server's own help
    bad = subprocess.run([*kvmem(), "serve", "-m", str(smollm2), "--no-such-llama-flag"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--no-such-llama-flag" in bad.stdout + bad.stderr


def test_rpc_server_loopback(smollm2: Path, tmp_path: Path) -> None:
    with rpc_server() as endpoint, launch.start_server(None, ctx=1024, rpc=endpoint, ready_timeout=180,
                                                       extra_args=["-lv", "4"]) as srv:
        command = srv.argv
        assert command[command.index("--rpc") + 1] == endpoint and "-ngl" in command
        reply = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
            "model": srv.model_id, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
        log = srv.log_text()
        assert f"using device RPC0 ({endpoint})" in log and "offloaded 31/31 layers" in log


ENGINE_PAIRS = ["bf16-bf16", "f16-f16", "q4_0-q4_0", "q5_0-q5_0", "q8_0-q8_0"]  # build-info's fa_quants


def test_the_gpu_attends_with_the_working_sets_types_under_tiering() -> None:
    q5 = ["-ctk", "q5_0", "-ctv", "q5_0"]
    assert argv.attended_kv_pair(q5, tiering=True) == "f16-f16"  # the f16 working set over a q5_0 pool
    assert argv.attended_kv_pair([*q5, "--kvmem-gpu-type", "same"], tiering=True) == "q5_0-q5_0"
    assert argv.attended_kv_pair(q5, tiering=False) == "q5_0-q5_0"
    assert argv.attended_kv_pair([], tiering=False) == "f16-f16"


def test_a_kv_pair_the_gpu_engine_has_no_kernel_for_is_named() -> None:
    mixed = ["-ctk", "q8_0", "-ctv", "q5_0", "-fa", "on"]
    why = argv.missing_fa_kernels(ENGINE_PAIRS, mixed, tiering=False)
    assert why is not None and "K/V q8_0/q5_0" in why and "run on the CPU" in why
    assert argv.missing_fa_kernels(ENGINE_PAIRS, mixed, tiering=True) is None  # the working set is f16
    assert argv.missing_fa_kernels(ENGINE_PAIRS, ["-ctk", "q5_0", "-ctv", "q5_0"], tiering=False) is None
    assert argv.missing_fa_kernels(["all"], mixed, tiering=False) is None
    assert argv.missing_fa_kernels(None, mixed, tiering=False) is None  # an engine built before the list was recorded
