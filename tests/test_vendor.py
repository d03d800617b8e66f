"""The pin: verification before extraction, and extraction of only the llama.cpp tree."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvmem_llama.errors import VerificationError
from kvmem_llama.vendor import PIN_FILE, Pin, load_pin
from kvmem_llama.vendor.fetch import VERIFIED_MARKER, extract_tree, verify_sdist


def make_sdist(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def pin_for(path: Path) -> Pin:
    data = path.read_bytes()
    return replace(load_pin(), size=len(data), sha256=hashlib.sha256(data).hexdigest())


def test_pin_file_holds_the_published_facts() -> None:
    raw = json.loads(PIN_FILE.read_text())
    pin = load_pin()
    assert pin.requirement == "llama-cpp-python==0.3.36"
    assert pin.filename == "llama_cpp_python-0.3.36.tar.gz"
    assert pin.size == 76_589_250
    assert pin.sha256 == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert pin.tree == "vendor/llama.cpp"
    assert raw["upstream_commit"] == "0c1e570"


def test_sdist_of_wrong_size_is_refused_before_extraction(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    make_sdist(sdist, {"llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt": b"project(x)\n"})
    dest = tmp_path / "tree"
    with pytest.raises(VerificationError, match="bytes, the pin says 76,589,250"):
        extract_tree(sdist, dest, load_pin())
    assert not dest.exists()


def test_tampered_sdist_of_right_size_is_refused(tmp_path: Path) -> None:
    pin = load_pin()
    sdist = tmp_path / pin.filename
    with open(sdist, "wb") as fh:  # right size, wrong bytes: only the hash can tell
        fh.truncate(pin.size)
    with pytest.raises(VerificationError, match=f"sha256 .* the pin says {pin.sha256}"):
        verify_sdist(sdist, pin)
    dest = tmp_path / "tree"
    with pytest.raises(VerificationError):
        extract_tree(sdist, dest, pin)
    assert not dest.exists()


def test_extracts_only_the_llama_cpp_tree(tmp_path: Path) -> None:
    sdist = tmp_path / "carrier.tar.gz"
    make_sdist(sdist, {
        "llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt": b"project(llama)\n",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/src/llama.cpp": b"int x;\n",
        "llama_cpp_python-0.3.36/llama_cpp/llama.py": b"python binding, not ours to build\n",
        "llama_cpp_python-0.3.36/vendor/other/README": b"not llama.cpp\n",
    })
    pin = pin_for(sdist)
    tree = extract_tree(sdist, tmp_path / "tree", pin)
    files = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    assert files == [VERIFIED_MARKER, "CMakeLists.txt", "src/llama.cpp"]
    assert json.loads((tree / VERIFIED_MARKER).read_text())["sha256"] == pin.sha256


def test_path_traversal_member_is_refused(tmp_path: Path) -> None:
    sdist = tmp_path / "evil.tar.gz"
    make_sdist(sdist, {"llama_cpp_python-0.3.36/vendor/llama.cpp/../../../escape.txt": b"x"})
    with pytest.raises(VerificationError, match="unsafe path"):
        extract_tree(sdist, tmp_path / "tree", pin_for(sdist))
    assert not (tmp_path / "escape.txt").exists()
