"""What this machine has: NVIDIA GPUs through NVML (nvidia-ml-py, the optional `gpu` extra), host RAM
through psutil.

Detection never raises: no nvidia-ml-py, no driver, no NVML library or no GPU all mean "no GPU", with
the reason kept in `Hardware.nvml_error` so `kvmem doctor` can show it.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

import psutil

from kvmem_llama.errors import KvmemError

_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """`16G`, `16GiB`, `16 GB`, `512M`, `64g` -> bytes (binary units: GPU and RAM sizes are sold that way)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise KvmemError(f"cannot read the size {text!r}", hint="write it like 16G, 24GiB or 512M")
    return int(float(match["num"]) * _UNITS[match["unit"].lower()])


@dataclass
class GPU:
    index: int
    name: str
    sm: str | None  # compute capability as an SM name: "86", "89", "90", "120"
    vram_total: int
    vram_free: int
    uuid: str = ""
    detected: bool = True  # False for a --vram override


@dataclass
class Hardware:
    gpus: list[GPU] = field(default_factory=list)
    ram_total: int = 0
    ram_available: int = 0
    cpu_count: int = 1
    driver: str | None = None
    cuda_driver: str | None = None  # highest CUDA version the driver supports, e.g. "13.0"
    nvml_error: str | None = None

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def gpu(self, index: int = 0) -> GPU | None:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        return self.gpus[0] if self.gpus else None

    def to_dict(self) -> dict:
        return asdict(self)


def _nvml():
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def detect_gpus() -> tuple[list[GPU], str | None, str | None, str | None]:
    """(gpus, driver version, CUDA driver version, why there are none)."""
    try:
        nv = _nvml()
    except ImportError:
        return [], None, None, "nvidia-ml-py is not installed (pip install 'kvmem-llama[gpu]')"
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], None, None, f"NVML unavailable: {exc}"
    try:
        driver = _text(nv.nvmlSystemGetDriverVersion())
        cuda = nv.nvmlSystemGetCudaDriverVersion_v2()
        cuda_text = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GPU(i, _text(nv.nvmlDeviceGetName(handle)), f"{major}{minor}", int(mem.total),
                            int(mem.free), _text(nv.nvmlDeviceGetUUID(handle))))
        return gpus, driver, cuda_text, None if gpus else "the driver reports no GPU"
    except Exception as exc:
        return [], None, None, f"NVML query failed: {exc}"
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


def detect(vram: str | int | None = None, ram: str | int | None = None, gpu_index: int = 0) -> Hardware:
    """Detected hardware; `vram`/`ram` override what was found (plan for another machine)."""
    gpus, driver, cuda, why = detect_gpus()
    mem = psutil.virtual_memory()
    hw = Hardware(gpus, int(mem.total), int(mem.available), os.cpu_count() or 1, driver, cuda, why)
    if vram is not None:
        size = parse_size(vram)
        real = hw.gpu(gpu_index)
        if size == 0:
            hw.gpus = []  # --vram 0: plan a CPU run
        elif real is not None:
            hw.gpus = [GPU(real.index, real.name, real.sm, size, size, real.uuid, detected=False)]
        else:
            hw.gpus = [GPU(gpu_index, "planned GPU", None, size, size, detected=False)]
    elif gpus:
        chosen = hw.gpu(gpu_index)
        hw.gpus = [chosen] if chosen else []
    if ram is not None:
        hw.ram_total = hw.ram_available = parse_size(ram)
    return hw


def process_vram(pids: list[int]) -> dict[int, int]:
    """GPU memory in use per pid (compute processes), {} without NVML."""
    try:
        nv = _nvml()
    except Exception:
        return {}
    usage: dict[int, int] = {}
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory:
                    usage[proc.pid] = usage.get(proc.pid, 0) + int(proc.usedGpuMemory)
    except Exception:
        return usage
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
    return usage
