"""Vision end to end: the projector pulled with a catalog model (sha256 checked), planned and passed by `kvmem run`,
images sent by `kvmem chat` (/image) and through the official `openai` client, and image input under KV tiering on
the real CPU engine (the synthetic qwen35 model + a synthetic qwen3vl_merger projector, random weights)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import httpx
import openai
import pytest
from hub_server import FakeHub, isolate_env
from test_kvmem_engine import essay
from test_synth_vision import TEXT_N_EMBD, data_uri, png

from kvmem_llama import chat, hardware, kvmem_log, models, paths, planner
from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.models.gguf_info import model_info
from kvmem_llama.synth_vision import PRESETS, synthesize_mmproj

REPO = "test-org/Tiny-VL-GGUF"


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory) -> Path:
    return synthesize_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj-tiny-F16.gguf", text_n_embd=TEXT_N_EMBD)


# --- images in the chat client, no server ---------------------------------------------------------------------------

def test_image_files_become_data_uri_parts_and_bad_files_are_explained(tmp_path: Path) -> None:
    good = tmp_path / "a.png"
    good.write_bytes(png(8, 8))
    part = chat.image_part(good)
    assert part["type"] == "image_url" and part["image_url"]["url"] == data_uri(good.read_bytes())
    (tmp_path / "b.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\0" * 16)
    assert chat.image_part(tmp_path / "b.jpg")["image_url"]["url"].startswith("data:image/jpeg;base64,")

    (tmp_path / "notes.txt").write_text("not an image")
    big = tmp_path / "big.png"
    with big.open("wb") as fh:
        fh.write(png(8, 8))
        fh.truncate(chat.MAX_IMAGE_BYTES + 1)
    for path, message in [(tmp_path / "notes.txt", "is not a PNG, JPEG, GIF or BMP image"),
                          (tmp_path / "missing.png", "cannot read"), (tmp_path, "is a directory"),
                          (big, "MiB: images up to 20 MiB")]:
        with pytest.raises(KvmemError, match=message):
            chat.image_part(path)


def test_an_image_waits_for_the_next_message_and_stays_in_the_saved_conversation(tmp_path: Path) -> None:
    image = tmp_path / "cat.png"
    image.write_bytes(png(16, 16))
    session = chat.ChatSession(chat.ChatClient("http://127.0.0.1:9", "m"))
    assert "cat.png" in session.command(f"/image {image}").text
    assert session.command("/image").text == "dropped 1 waiting image"
    with pytest.raises(KvmemError, match="/image takes one file name"):
        session.command("/image a.png b.png")
    conv = chat.Conversation()
    conv.add([{"type": "text", "text": "what is this?"}, chat.image_part(image)], "a cat")
    conv.save(tmp_path / "c.json")
    again = chat.Conversation.load(tmp_path / "c.json")
    assert again.messages() == conv.messages()
    bad = {"messages": [{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]}
    with pytest.raises(KvmemError, match="is not a"):  # only user messages carry parts
        chat.Conversation.from_json(bad)


# --- the projector in the catalog, the store and the plan ----------------------------------------------------------

@pytest.mark.engine
def test_a_catalog_model_pulls_its_projector_checked_and_run_passes_it(monkeypatch, tmp_path, cpu_engine, qwen35,
                                                                         mmproj) -> None:
    engines = paths.engines_dir()
    with FakeHub() as hub:
        hub.add_file(REPO, "tiny-vl-Q4_K.gguf", qwen35["plain"].read_bytes())
        sha = hub.add_file(REPO, "mmproj-tiny-F16.gguf", mmproj.read_bytes())
        hub.add_file(REPO, "mmproj-tiny-F32.gguf", b"not this one")
        home = isolate_env(monkeypatch, tmp_path, hub)
        home.mkdir(parents=True, exist_ok=True)
        (home / "engines").symlink_to(engines)  # the built engines, for kvmem run --dry-run
        entry = {"repo": REPO, "quant": ["*Q4_K.gguf"], "arch": "qwen35", "mmproj": ["mmproj-*F16.gguf"]}
        (home / "catalog.json").write_text(json.dumps({"models": {
            "vl": {**entry, "mmproj_sha256": sha},
            "vl:pinned": {**entry, "mmproj_sha256": "0" * 64},
            "vl:novision": {"repo": REPO, "quant": ["*Q4_K.gguf"]},
        }}))
        resolved = models.resolve_model("vl", pull=True)
        projector, _ = models.projector_record(resolved)
        assert projector is not None and Path(projector.path).read_bytes() == mmproj.read_bytes()
        assert "vl:mmproj" in projector.aliases
        with pytest.raises(VerificationError, match="catalog expects"):  # the projector's hash is checked too
            models.pull_model("vl:pinned", backoff=0.01)
        plain = models.resolve_model("vl:novision", pull=True)

    path, note = models.vision_projector(resolved, "")
    assert path == Path(projector.path) and "vision: mmproj-tiny-F16.gguf" in note
    assert models.vision_projector(resolved, "none") == (None, None)
    assert models.vision_projector(plain, "") == (None, None)
    with pytest.raises(KvmemError, match="not a vision projector"):
        models.vision_projector(resolved, str(qwen35["plain"]))
    with pytest.raises(KvmemError, match="no such vision projector file"):
        models.vision_projector(resolved, str(tmp_path / "nope.gguf"))

    dry = subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", "run", "vl", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert f"--mmproj {projector.path}" in " ".join(dry.stdout.split()), dry.stdout
    no = subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", "run", "vl", "--dry-run", "--mmproj", "none"],
                        capture_output=True, text=True, timeout=120)
    assert no.returncode == 0 and "--mmproj" not in no.stdout
    plan = subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", "plan", "vl", "--vram", "24G", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    ledger = {row["item"]: row["bytes"] for row in json.loads(plan.stdout)["ledger"]}
    assert ledger["vision projector"] == mmproj.stat().st_size


def test_the_plan_counts_the_projector_in_vram_or_ram(qwen35) -> None:
    info = model_info(qwen35["plain"])
    gpu = hardware.detect(vram="1G", ram="16G")
    size = 200 << 20
    without = planner.plan(info, gpu, ctx=262144)
    with_gpu = planner.plan(info, gpu, ctx=262144, mmproj_bytes=size)
    in_ram = planner.plan(info, gpu, ctx=262144, mmproj_bytes=size, mmproj_offload=False)
    rows = {item: (b, note) for item, b, note in with_gpu.ledger}
    assert rows["vision projector"][0] == size
    on_gpu = ("weights on GPU", "compute buffers", "runtime overhead", "KV working set", "MTP draft",
              "vision projector", "block summaries")
    assert rows["VRAM left"][0] == rows["VRAM"][0] - sum(rows[item][0] for item in on_gpu)  # counted as used
    assert without.fits and with_gpu.fits
    assert with_gpu.profile.budget > 0 and any("--no-mmproj-offload" in w for w in with_gpu.warnings)
    short = planner.plan(info, hardware.detect(vram="512M", ram="16G"), ctx=262144, mmproj_bytes=size)
    assert any("--no-mmproj-offload" in fix for fix in short.fixes)
    ram_rows = {item: (b, note) for item, b, note in in_ram.ledger}
    assert ram_rows["vision projector"] == (0, "in RAM (--no-mmproj-offload)")
    cpu = planner.plan(info, hardware.detect(vram="0", ram="16G"), ctx=8192, mmproj_bytes=size)
    weights = {item: (b, note) for item, b, note in cpu.ledger}["weights (mmap)"]
    assert weights[0] == info.trunk_weights_bytes + size and "vision projector 200 MiB" in weights[1]


# --- the engine: images with tiering on ------------------------------------------------------------------------------

def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", timeout=300, max_retries=0)


def ask(cli: openai.OpenAI, content: list[dict], history: list[dict] | None = None, n: int = 8):
    messages = [*(history or []), {"role": "user", "content": content}]
    return cli.chat.completions.create(model="any", messages=messages, max_tokens=n, temperature=0, logprobs=True,
                                       top_logprobs=2)


def greedy(r) -> list[tuple[str, float]]:
    return [(t.token, round(t.logprob, 3)) for t in r.choices[0].logprobs.content]


def image_prompt(before: str, image: bytes, after: str) -> list[dict]:
    return [{"type": "text", "text": before}, {"type": "image_url", "image_url": {"url": data_uri(image)}},
            {"type": "text", "text": after}]


@pytest.mark.engine
def test_an_image_under_tiering_with_room_for_everything_is_token_identical_to_tiering_off(llama_server, qwen35,
                                                                                            mmproj) -> None:
    content = image_prompt(essay(12), png(96, 64, seed=1), "What is in the picture? " + essay(2))
    answers = {}
    for budget in ("0", "4096"):
        with llama_server(qwen35["plain"], ["--mmproj", str(mmproj), "-c", "4096", "-np", "1",
                                            "--kvmem-budget", budget]) as srv:
            answers[budget] = ask(client(srv.url), content)
            log = srv.log()
        if budget != "0":
            assert "kvmem_score: ARMED" in log and "DISABLED" not in log
    assert greedy(answers["4096"]) == greedy(answers["0"])
    assert answers["4096"].usage.prompt_tokens == answers["0"].usage.prompt_tokens


def ask_slot(cli: openai.OpenAI, slot: int, what: list[dict] | str):
    text = [{"type": "text", "text": what}] if isinstance(what, str) else what
    return cli.chat.completions.create(model="any", messages=[{"role": "user", "content": text}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"id_slot": slot})


def trace_blocks(log: str, what: str, seq: int) -> list[int]:
    """The blocks of `kvmem_trace: <what> seq=<seq> block=N` lines, in order."""
    return [int(m[1]) for m in re.finditer(rf"kvmem_trace: {what} seq={seq} block=(\d+)", log)]


@pytest.mark.engine
def test_a_long_tiered_conversation_moves_its_image_to_the_host_pool_and_scores_it(llama_server, qwen35,
                                                                                   mmproj) -> None:
    """An image early in a prompt three times the working set: its block (all its tokens: they share one M-RoPE
    position) goes to the host pool whole and leaves the working set like the text around it; each turn scores it
    like any other block; the answer and a follow-up turn (with the image in the history) run."""
    first = image_prompt(essay(60), png(128, 128, seed=2), essay(200) + " What was in the picture?")
    with llama_server(qwen35["plain"], ["--mmproj", str(mmproj), "-c", "8192", "-np", "1",
                                        "--kvmem-budget", "1024", "--kvmem-refresh", "16", "--kvmem-trace"]) as srv:
        cli = client(srv.url)
        answer = ask(cli, first)
        history = [{"role": "user", "content": first},
                   {"role": "assistant", "content": answer.choices[0].message.content}]
        again = ask(cli, [{"type": "text", "text": "And its colours?"}], history, n=64)
        slot = httpx.get(srv.url + "/slots", timeout=10, trust_env=False).json()[0]
        log = srv.log()
    assert answer.usage.prompt_tokens > 3 * 1024
    assert again.usage.prompt_tokens > answer.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= answer.usage.prompt_tokens  # the history was kept
    assert slot["kvmem"]["blocks_host"] > 0, slot["kvmem"]
    assert "GGML_ASSERT" not in log and "kvmem_score: ARMED" in log
    # the image (4x4 tokens after the 2x2 merge) is one block of its own shape in the host pool
    images = re.findall(r"kvmem_trace: image seq=0 block=(\d+) cells=(\d+) slots=(\d+)", log)
    assert len(images) == 1, images
    image_block, cells = int(images[0][0]), int(images[0][1])
    assert cells >= PRESETS["tiny"].n_image_tokens(128, 128)
    assert image_block in trace_blocks(log, "evict", 0)  # the prompt read on past it: it left the working set
    turns = [e for e in kvmem_log.selects(log.splitlines()) if e["reason"] == "turn"]
    assert len(turns) >= 2 and all(e["n_blocks"] > e["budget_blocks"] for e in turns)  # history beyond the budget
    assert all(e["image_blocks"] == 1 for e in turns), turns
    # every turn scores it (its summary is built from all its cells' keys)
    ranked = [e["attention"] for e in kvmem_log.rankings(log) if e["seq"] == 0 and e["reason"] == "turn"]
    assert len(ranked) >= 2 and all(image_block in r for r in ranked), ranked
    # while the answer is generated the image's cells are counted: re-selections come every --kvmem-refresh
    # tokens, not at every token for want of room
    during = [e for e in kvmem_log.selects(log.splitlines()) if e["reason"] in ("refresh", "room")]
    assert len(during) >= 2, during
    assert all(b["pos"] - a["pos"] >= 8 for a, b in pairwise(during) if b["pos"] > a["pos"]), during


@pytest.mark.engine
def test_an_image_evicted_by_another_slot_comes_back_whole_and_the_answer_is_tiering_offs(llama_server, qwen35,
                                                                                          mmproj, tmp_path) -> None:
    """Slot 0 asks about an image; slot 1's long prompt then takes the working set, evicting slot 0's blocks, the
    image's among them, to the host pool. Slot 0 asks again: its history fits its share, so the turn brings every
    block back (the image's cells whole, at their shared position) and recomputes the question: the answer is
    tiering off's, token for token. Saved while the image is in the host pool and restored into another server,
    the slot answers the same."""
    content = image_prompt(essay(10), png(96, 64, seed=5), "What is in the picture? " + essay(12))
    with llama_server(qwen35["plain"], ["--mmproj", str(mmproj), "-c", "4096", "-np", "1",
                                        "--kvmem-budget", "0"]) as srv:
        reference = ask_slot(client(srv.url), 0, content)
    tiered = ["--mmproj", str(mmproj), "-c", "8192", "-np", "2", "--kv-unified", "--kvmem-budget", "1024",
              "--kvmem-trace", "--slot-save-path", str(tmp_path)]
    with llama_server(qwen35["plain"], tiered) as srv:
        cli = client(srv.url)
        first = ask_slot(cli, 0, content)
        ask_slot(cli, 1, essay(150))
        saved = httpx.post(f"{srv.url}/slots/0", params={"action": "save"}, json={"filename": "s0.bin"}, timeout=600)
        again = ask_slot(cli, 0, content)
        log = srv.log()
    assert saved.status_code == 200, saved.text
    with llama_server(qwen35["plain"], tiered) as srv:
        restored = httpx.post(f"{srv.url}/slots/0", params={"action": "restore"}, json={"filename": "s0.bin"},
                              timeout=600)
        assert restored.status_code == 200, restored.text
        resumed = ask_slot(client(srv.url), 0, content)
        resumed_log = srv.log()
    assert "GGML_ASSERT" not in log
    images = trace_blocks(log, "image", 0)
    assert len(images) == 1, log[-3000:]
    assert images[0] in trace_blocks(log, "evict", 0)  # slot 1's prompt took its cells
    turns = [e for e in kvmem_log.selects(log.splitlines()) if e["seq"] == 0 and e["reason"] == "turn"]
    assert turns[-1]["staged_in"] >= 1 and turns[-1]["image_blocks"] == 1 and turns[-1]["image_resident"] == 1, turns
    # the prompt's last batch (all the server decodes again) is recomputed once the blocks are back: this hybrid
    # model's recurrent state is restored from before that batch
    recomputes = [e for e in kvmem_log.iter_events(log.splitlines()) if e["event"] == "TURN" and e["seq"] == 0]
    assert recomputes[-1]["recompute_tokens"] >= 1, recomputes
    assert greedy(first) == greedy(reference)  # nothing had left yet: the same cells, the same sums
    # after the round trip the cells are others, and the CPU's flash attention sums V in f16 in cell order: the
    # answer is tiering off's to within that rounding, token for token until a near tie could go either way
    assert_near(again, reference)
    # the restored slot holds the image's block in its host pool, and its turn brings it back
    restored_turns = [e for e in kvmem_log.selects(resumed_log.splitlines()) if e["seq"] == 0 and e["reason"] == "turn"]
    assert restored_turns[-1]["image_blocks"] == 1 and restored_turns[-1]["image_resident"] == 1, restored_turns
    assert "GGML_ASSERT" not in resumed_log
    assert_near(resumed, reference)


# a host pool of 16 tiny-qwen35 blocks (128 KiB each); slot 0 holds an image's block of two slots. Roomy: slot 1's
# 14 blocks push out a few of slot 0's, the image's among them, into a tier as large as the pool. Full: slot 0's 9
# blocks and slot 1's 15 send exactly 8 of slot 0's to a tier of 8, so that slot 0 comes back through a full pool
# over a full tier (its blocks trade places with slot 1's one-slot blocks, the image's two records with two of them)
@pytest.mark.engine
@pytest.mark.parametrize(("essay_after", "essay_slot1", "disk_mib"), [(12, 130, None), (70, 140, "1")],
                         ids=["roomy-tier", "full-tier"])
def test_an_idle_slots_image_goes_to_the_disk_tier_and_comes_back_whole(llama_server, qwen35, mmproj, tmp_path,
                                                                      essay_after, essay_slot1, disk_mib) -> None:
    """With a host pool too small for both slots, slot 1's long prompt sends idle slot 0's blocks to the disk
    tier, its image's block too (a record for each of its slots). Slot 0 asks again: its blocks come back into the
    pool (slot 1's leave for them), the image's whole, and the answer is tiering off's."""
    content = image_prompt(essay(10), png(96, 64, seed=5), "What is in the picture? " + essay(essay_after))
    with llama_server(qwen35["plain"], ["--mmproj", str(mmproj), "-c", "4096", "-np", "1",
                                        "--kvmem-budget", "0"]) as srv:
        reference = ask_slot(client(srv.url), 0, content)
    disk = tmp_path / "disk"
    disk.mkdir()
    sized = ["--kvmem-disk-mib", disk_mib] if disk_mib else []
    with llama_server(qwen35["plain"], ["--mmproj", str(mmproj), "-c", "8192", "-np", "2", "--kv-unified",
                                        "--kvmem-budget", "1024", "--kvmem-trace", "--kvmem-host-mib", "2",
                                        "--kvmem-disk-path", str(disk), *sized]) as srv:
        cli = client(srv.url)
        ask_slot(cli, 0, content)
        ask_slot(cli, 1, essay(essay_slot1))
        away = kvmem_slots(srv.url)
        again = ask_slot(cli, 0, content)
        back = kvmem_slots(srv.url)
        log = srv.log()
    assert "GGML_ASSERT" not in log and "purging slot" not in log
    images = re.findall(r"kvmem_trace: image seq=0 block=(\d+) cells=\d+ slots=(\d+)", log)
    assert len(images) == 1 and int(images[0][1]) >= 2, images
    spilled = re.findall(r"kvmem_trace: spill seq=0 block=(\d+) slots=(\d+)", log)
    assert images[0] in spilled, (images, spilled)
    assert away[0]["blocks_disk"] >= int(images[0][1]) and away[1]["blocks_disk"] == 0, away
    if disk_mib:
        assert away[0]["blocks_disk"] == 8, away  # the tier was full when slot 0 came back
    assert "back from the disk tier" in log and back[0]["blocks_disk"] == 0 and back[1]["blocks_disk"] > 0, back
    turns = [e for e in kvmem_log.selects(log.splitlines()) if e["seq"] == 0 and e["reason"] == "turn"]
    assert turns[-1]["image_blocks"] == 1 and turns[-1]["image_resident"] == 1, turns
    assert_near(again, reference)
    assert list(disk.iterdir()) == []


def kvmem_slots(url: str) -> dict[int, dict]:
    return {s["id"]: s["kvmem"] for s in httpx.get(f"{url}/slots", timeout=30, trust_env=False).json()}


def assert_near(got, reference) -> None:
    """got's greedy answer is reference's within f16 rounding: each logprob close, the same token until a near tie."""
    for g, ref in zip(got.choices[0].logprobs.content, reference.choices[0].logprobs.content, strict=True):
        assert abs(g.logprob - ref.logprob) < 0.05, (g, ref)
        if ref.top_logprobs[0].logprob - ref.top_logprobs[1].logprob < 0.1:
            break
        assert g.token == ref.token, (g, ref)


@pytest.mark.engine
def test_an_image_larger_than_the_working_set_is_refused_with_the_budget_it_needs(llama_server, qwen35,
                                                                                   mmproj) -> None:
    with llama_server(qwen35["plain"], ["--mmproj", str(mmproj), "-c", "8192", "-np", "1",
                                        "--kvmem-budget", "1024"]) as srv:
        cli = client(srv.url)
        with pytest.raises(openai.BadRequestError) as refused:  # 1024x1024: 32x32 = 1,024 image tokens
            ask(cli, image_prompt("Look:", png(1024, 1024, seed=3), "What is it?"))
        small = ask(cli, image_prompt("Look:", png(64, 64, seed=3), "What is it?"))  # the server goes on
        log = srv.log()
    message = str(refused.value)
    match = re.search(r"an image of 1024 tokens does not fit the KV tiering working set \(--kvmem-budget 1024\).*"
                      r"needs --kvmem-budget (\d+) or more", message)
    assert match, message
    assert int(match[1]) > 1024 + 128 and int(match[1]) % 128 == 0
    assert small.choices[0].message.content is not None and "GGML_ASSERT" not in log


@pytest.mark.engine
def test_kvmem_chat_sends_an_image_with_the_next_message(cpu_engine, qwen35, mmproj, tmp_path: Path) -> None:
    """`kvmem chat MODEL --mmproj FILE` starts the server with the projector; /image FILE goes with the next
    message (the server encodes it), stays in the conversation, and a file that is no image is explained."""
    import pexpect

    image, saved = tmp_path / "shapes.png", tmp_path / "chat.json"
    image.write_bytes(png(96, 96, seed=4))
    (tmp_path / "notes.txt").write_text("hello")
    env = {**os.environ, "KVMEM_SERVERS_DIR": str(tmp_path / "servers"), "NO_COLOR": "1", "TERM": "dumb",
           "COLUMNS": "250"}
    args = ["-m", "kvmem_llama.cli.main", "chat", str(qwen35["plain"]), "--mmproj", str(mmproj), "--max-tokens", "8",
            "--", "--kvmem-budget", "0", "-c", "4096", "-np", "1"]
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=300, dimensions=(60, 250))
    try:
        child.expect(r"ready http://127\.0\.0\.1:\d+")
        child.expect_exact(">>> ")
        child.sendline(f"/image {tmp_path / 'notes.txt'}")
        child.expect_exact("is not a PNG, JPEG, GIF or BMP image")
        child.expect_exact(">>> ")

        def prompt_tokens() -> int:
            child.sendline("/stats")
            child.expect(r"prompt ([\d,]+) tokens")
            n = int(child.match[1].replace(",", ""))
            child.expect_exact(">>> ")
            return n

        child.sendline("What is in this picture?")
        child.expect_exact(">>> ")
        text_only = prompt_tokens()
        child.sendline("/clear")
        child.expect_exact(">>> ")
        child.sendline(f"/image {image}")
        child.expect_exact("shapes.png")
        child.expect_exact(">>> ")
        child.sendline("What is in this picture?")
        child.expect_exact(">>> ")
        with_image = prompt_tokens()
        child.sendline(f"/save {saved}")
        child.expect_exact("saved 2 messages")
        child.expect_exact(">>> ")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        if child.isalive():
            child.terminate(force=True)
    assert with_image - text_only == PRESETS["tiny"].n_image_tokens(96, 96) + 2  # + vision start and end
    first = json.loads(saved.read_text("utf-8"))["messages"][0]["content"]
    assert first[0] == {"type": "text", "text": "What is in this picture?"}
    assert first[1]["image_url"]["url"] == data_uri(image.read_bytes())


@pytest.mark.engine
def test_kvmem_bench_puts_an_image_at_the_start_of_turn_1_and_decodes_after_it(cpu_engine, qwen35, mmproj,
                                                                               tmp_path: Path) -> None:
    """`kvmem bench --image --image-at 512`: turn 1 is 512 tokens of text, the image, then text up to the context
    (the image's block in the host pool under tiering), turn 2 continues it; the rows carry the image's tokens and
    the server's encode and decode times. Without --mmproj the option is refused with what to add."""
    image = tmp_path / "bench.png"
    image.write_bytes(png(128, 128, seed=6))
    out = tmp_path / "bench"
    base = ["kvmem", "bench", "--engine", str(cpu_engine.path), "--model", str(qwen35["plain"]), "--contexts", "2048",
            "--gen", "8", "--repeats", "2", "--image", str(image), "--image-at", "512", "--out", str(out)]
    for config, extra in (("off", ""), ("on", " --kvmem-budget 512 --kvmem-block 64 --kvmem-recent 128")):
        run = subprocess.run([*base, "--config", config, "--server-args", f"-t 2 --mmproj {mmproj}{extra}"],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "image 18 tokens: encoded" in run.stdout, run.stdout
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["config"], r["repeat"]) for r in rows] == [("off", 0), ("off", 1), ("on", 0), ("on", 1)]
    for row in rows:
        assert row["error"] is None and row["decode_tokens"] == 8, row
        assert row["image_tokens"] == PRESETS["tiny"].n_image_tokens(128, 128) + 2  # with <|vision_start|>/_end|>
        assert row["image_encode_ms"] is not None and row["image_decode_ms"] is not None
        # turn 2 read its ~512 new tokens: the image and the text after it came from the prompt cache
        assert 2048 - 64 <= row["turn2_cached_tokens"] <= 2048 + 18 and row["turn2_prompt_tokens"] <= 512 + 64, row
    tiered = [r for r in rows if r["config"] == "on"]
    assert all(r["select_ms"] for r in tiered)  # turn 2 selected over a history of 4x the budget
    (log,) = [p for p in (out / "logs").iterdir() if p.name.startswith("on-")]
    assert re.search(r"image_blocks=1 image_resident=[01] ", log.read_text())
    refused = subprocess.run([*base, "--config", "x", "--server-args", "-t 2"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "add --mmproj FILE to --server-args" in refused.stderr

