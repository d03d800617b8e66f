"""The disk tier under the host pool (--kvmem-disk-path): when the pool is full, an idle slot's blocks go to disk
and come back when it runs again, with the answers of a server whose pool never filled; a tier that cannot be
had is refused at start, and one that fills up fails the request with the reason and loses nothing."""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import httpx
import pytest
from test_kvmem_engine import complete, kvmem_metrics

from kvmem_llama.engine import Engine

# SmolLM2-135M: a block of 64 tokens is 1.4 MiB in the f16 pool; 72 MiB holds ~50 blocks, one document and a bit
TIERING = ["-c", "8192", "-np", "2", "--kv-unified", "--kvmem-budget", "512", "--kvmem-block", "64",
           "--kvmem-sink", "64", "--kvmem-recent", "128", "-b", "512", "-ub", "512"]
SMALL_POOL = ["--kvmem-host-mib", "72"]


def document(seed: int, needle: str, n_sentences: int = 190) -> str:
    rng = random.Random(seed)
    words = "river stone light window garden music paper engine winter market bridge forest signal".split()
    sentences = [f"In chapter {i} the {rng.choice(words)} met the {rng.choice(words)} near the {rng.choice(words)}."
                 for i in range(n_sentences)]
    sentences.insert(n_sentences // 3, needle)
    return " ".join(sentences)


DOCS = {
    0: (document(1, "The secret code word is PAPAYA-71."), " Question: what is the secret code word? Answer:",
        " Question: repeat the secret code word once more. Answer:"),
    1: (document(2, "The vault number is 4812."), " Question: what is the vault number? Answer:",
        " Question: repeat the vault number once more. Answer:"),
}


def _conversation(url: str) -> tuple[list[list[int]], list[dict], list[int]]:
    """Slot 0 reads its document and answers, slot 1 reads its own (the pool fills), then both ask a follow-up:
    the answers (tokens with their top log-probabilities), the slots' tiering state after each request, and the
    prompt tokens each one read."""
    answers, states, read = [], [], []
    history: dict[int, str] = {}
    for slot, turn in ((0, 1), (1, 1), (0, 2), (1, 2)):
        doc, first, follow_up = DOCS[slot]
        prompt = doc + first if turn == 1 else history[slot] + follow_up
        reply = complete(url, prompt, n_predict=10, cache_prompt=True, id_slot=slot, n_probs=3)
        history[slot] = prompt + reply["content"]
        # the tokens and their probabilities: the bytes that come back from disk must be the very bytes that left
        answers.append([(t["id"], [(c["id"], c["logprob"]) for c in t["top_logprobs"]])
                        for t in reply["completion_probabilities"]])
        read.append(reply["timings"]["prompt_n"])
        states.append({s["id"]: s.get("kvmem", {}) for s in httpx.get(f"{url}/slots", timeout=30).json()})
    return answers, states, read


# the disk tier: as large as the pool, or (host scorer: 1.41 MiB records) exactly the 35 blocks slot 0 leaves there,
# so that the two slots then trade places through a full pool over a full tier
@pytest.mark.parametrize(("score_on", "disk_mib"), [("host", None), ("device", None), ("host", "50")])
def test_an_idle_slot_goes_to_disk_and_comes_back_with_the_same_answers(llama_server, smollm2, tmp_path: Path,
                                                                         score_on: str, disk_mib: str | None) -> None:
    flags = [*TIERING, "--kvmem-score-on", score_on, "--metrics"]
    with llama_server(smollm2, flags) as roomy:
        expected, _, _ = _conversation(roomy.url)
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    sized = ["--kvmem-disk-mib", disk_mib] if disk_mib else []
    with llama_server(smollm2, [*flags, *SMALL_POOL, "--kvmem-disk-path", str(disk_dir), *sized]) as srv:
        answers, states, read = _conversation(srv.url)
        log = srv.log()
        metrics = kvmem_metrics(srv.url)
    tier = re.search(r"disk tier (\d+) blocks \([\d.]+ MiB\) under " + re.escape(str(disk_dir)), log)
    assert tier, log[-3000:]
    if disk_mib:
        assert int(tier.group(1)) == states[1][0]["blocks_disk"] == 35  # the tier was full when slot 0 came back
    assert "moved to the disk tier" in log and "back from the disk tier" in log, log[-3000:]
    assert "purging slot" not in log
    assert states[1][0]["blocks_disk"] > 0 and states[1][1]["blocks_disk"] == 0  # slot 0 waited on disk
    assert states[2][0]["blocks_disk"] == 0 and states[2][1]["blocks_disk"] > 0  # and slot 1 took its turn there
    assert metrics["kvmem_blocks_disk"] > 0
    assert read[2] < 100 and read[3] < 100, read  # the follow-ups read only their own tokens
    assert answers == expected  # the bytes and summaries that came back are those that left
    assert list(disk_dir.iterdir()) == []  # the tier's file was never in the directory


@pytest.mark.parametrize("disk_mib", [None, 4])
def test_without_room_on_disk_the_full_pool_purges_the_idle_slot(llama_server, smollm2, tmp_path: Path,
                                                                 disk_mib: int | None) -> None:
    """Without a disk tier (or with one too small to hold the idle slot), the server frees the full pool as it
    frees a full KV cache: the idle slot's history is dropped, and each follow-up reads its document again (the
    work the disk tier keeps)."""
    disk = [] if disk_mib is None else ["--kvmem-disk-path", str(tmp_path), "--kvmem-disk-mib", str(disk_mib)]
    with llama_server(smollm2, [*TIERING, *SMALL_POOL, *disk]) as srv:
        _, _, read = _conversation(srv.url)
        log = srv.log()
    assert "purging slot 0" in log and "purging slot 1" in log
    if disk_mib:
        assert "moved to the disk tier" in log and "the disk tier is full (2 blocks" in log, log[-3000:]
    assert read[2] > 2000 and read[3] > 2000, read  # each slot read its document again


@pytest.mark.parametrize(("extra", "said"), [
    (["--kvmem-disk-mib", "1000000000"], "MiB free; --kvmem-disk-mib asks for 1000000000"),
    (["--kvmem-disk-mib", "64"], None),  # needs the path
])
def test_a_disk_tier_that_cannot_be_had_stops_the_server_at_start(cpu_engine: Engine, smollm2, tmp_path: Path,
                                                                  extra: list[str], said: str | None) -> None:
    args = [*TIERING, *extra] if said is None else [*TIERING, "--kvmem-disk-path", str(tmp_path), *extra]
    proc = subprocess.run([str(cpu_engine.server), "-m", str(smollm2), "--port", "0", *args], capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert (said or "--kvmem-disk-mib 64 needs --kvmem-disk-path") in out, out[-2000:]


def test_a_slot_saved_while_on_disk_restores_whole_into_a_full_pool(llama_server, smollm2, tmp_path: Path) -> None:
    """A slot save reads the blocks that wait on disk; its restore into a full pool sends the other slot's blocks
    to disk; the follow-up answers as the server that never saved."""
    with llama_server(smollm2, TIERING) as roomy:
        expected, _, _ = _conversation(roomy.url)
    slots, disk_dir = tmp_path / "slots", tmp_path / "disk"
    slots.mkdir()
    disk_dir.mkdir()
    args = [*TIERING, *SMALL_POOL, "--kvmem-disk-path", str(disk_dir), "--slot-save-path", str(slots)]
    with llama_server(smollm2, args) as srv:
        doc0, first0, follow0 = DOCS[0]
        reply0 = complete(srv.url, doc0 + first0, n_predict=10, cache_prompt=True, id_slot=0)
        doc1, first1, _ = DOCS[1]
        complete(srv.url, doc1 + first1, n_predict=10, cache_prompt=True, id_slot=1)
        on_disk = {s["id"]: s["kvmem"]["blocks_disk"] for s in httpx.get(f"{srv.url}/slots", timeout=30).json()}
        assert on_disk[0] > 0, on_disk
        saved = httpx.post(f"{srv.url}/slots/0", params={"action": "save"}, json={"filename": "s0.bin"}, timeout=600)
        assert saved.status_code == 200, saved.text
        assert httpx.post(f"{srv.url}/slots/0", params={"action": "erase"}, timeout=60).status_code == 200
        # slot 1 fills the pool again
        complete(srv.url, doc1 + first1 + " And again:", n_predict=4, cache_prompt=True, id_slot=1)
        restored = httpx.post(f"{srv.url}/slots/0", params={"action": "restore"}, json={"filename": "s0.bin"},
                              timeout=600)
        assert restored.status_code == 200, restored.text
        reply = complete(srv.url, doc0 + first0 + reply0["content"] + follow0, n_predict=10, cache_prompt=True,
                         id_slot=0)
    assert reply["timings"]["prompt_n"] < 100  # the history came back from the file, not by reading it again
    assert [t[0] for t in expected[2]] == reply["tokens"]
