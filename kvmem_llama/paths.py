"""Where kvmem keeps its state. KVMEM_HOME overrides everything (tests, portable installs)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "kvmem"


def home() -> Path:
    """Root of persistent data: engines, models, server records."""
    override = os.environ.get("KVMEM_HOME")
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_data_dir(APP))


def cache_dir() -> Path:
    """Re-creatable data: the upstream sdist, patched trees, build directories."""
    override = os.environ.get("KVMEM_CACHE")
    if override:
        return Path(override).expanduser()
    if os.environ.get("KVMEM_HOME"):
        return home() / "cache"
    return Path(platformdirs.user_cache_dir(APP))


def engines_dir() -> Path:
    return home() / "engines"


def models_dir() -> Path:
    return home() / "models"


def servers_dir() -> Path:
    return home() / "servers"


def kv_disk_dir() -> Path:
    """The disk tier's directory for servers started by kvmem run ($KVMEM_KV_DISK_DIR overrides)."""
    override = os.environ.get("KVMEM_KV_DISK_DIR")
    return Path(override).expanduser() if override else home() / "kv-disk"
