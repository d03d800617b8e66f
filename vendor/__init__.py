"""The pin of upstream llama.cpp and the code that fetches and verifies it.

The upstream source is never committed: it arrives at build time inside a registry
package (see pin.json), is verified byte for byte, and only then extracted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PIN_FILE = Path(__file__).resolve().parent / "pin.json"


@dataclass(frozen=True)
class Pin:
    upstream_version: str
    upstream_commit: str
    package: str
    version: str
    filename: str
    size: int
    sha256: str
    tree: str  # path of the llama.cpp tree inside the archive, below its top folder

    @property
    def short(self) -> str:
        """A short id for cache keys: which exact upstream bytes."""
        return self.sha256[:12]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def load_pin(path: Path = PIN_FILE) -> Pin:
    data = json.loads(path.read_text(encoding="utf-8"))
    carrier = data["carrier"]
    return Pin(
        upstream_version=data["upstream_version"],
        upstream_commit=data["upstream_commit"],
        package=carrier["package"],
        version=carrier["version"],
        filename=carrier["filename"],
        size=int(carrier["size"]),
        sha256=carrier["sha256"].lower(),
        tree=carrier["tree"],
    )
