"""The README's two commands stay true: CI runs the test command verbatim; lint stays clean."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_starts_with_install_and_test_commands() -> None:
    commands = readme_commands()
    assert len(commands) >= 2
    install, test = commands[0], commands[1]
    assert install.startswith("pip install") and "kvmem build" in install and "kvmem generate" in install
    assert "pytest" in test


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert readme_commands()[1] in ci.splitlines()


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff")
    assert ruff, "ruff is part of the test extras"
    out = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
