"""What this machine has for a job: available memory, free GPU memory, free disk. Stdlib only.

The pre-flight checks (`dynmo.checks.memory` for `dynmo train`, `dynmo.tensor.budget` for
`dynmo tensor`) read the machine through these three functions and nothing else. Each figure
can be set instead of read, for tests and for machines whose own figures mislead (a container
whose /proc/meminfo shows the host's memory):

    DYNMO_MEMORY_AVAILABLE   bytes of RAM available to new work (suffixes K, M, G, T allowed)
    DYNMO_GPU_FREE           free bytes of each local GPU, comma-separated ("" = no GPU)
    DYNMO_DISK_FREE          free bytes on every file system

RAM: /proc/meminfo's MemAvailable (what the kernel could give without swapping), lowered to
what is left under the process's cgroup memory limit where one is set. GPUs: `nvidia-smi`'s
free memory per device, so the caller never initialises CUDA (a CUDA context in the launcher
would hold memory on device 0 for the whole run). None where the figure cannot be read: the
checks then skip that comparison rather than guess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

MEMORY_ENV, GPU_ENV, DISK_ENV = "DYNMO_MEMORY_AVAILABLE", "DYNMO_GPU_FREE", "DYNMO_DISK_FREE"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_CGROUP = Path("/sys/fs/cgroup")


def parse_bytes(text: str, name: str) -> int:
    """'1073741824', '1G', '2.5T' -> bytes; ValueError naming `name` otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"{name}={text!r}: give bytes, e.g. 8G or 8589934592") from None
    if not value >= 0:
        raise ValueError(f"{name}={text!r}: give a number of bytes >= 0")
    return int(value)


def memory_available() -> int | None:
    """Bytes of RAM new work can have now, None if this platform cannot say."""
    if MEMORY_ENV in os.environ:
        return parse_bytes(os.environ[MEMORY_ENV], MEMORY_ENV)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        avail = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    room = _cgroup_room()
    return avail if room is None else min(avail, room)


def _cgroup_room() -> int | None:
    """What the cgroup (v2) memory limit leaves, None without a limit."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((_CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def gpu_free() -> list[int] | None:
    """Free bytes of each GPU this machine's NVIDIA driver lists, None when none can be read."""
    if GPU_ENV in os.environ:
        text = os.environ[GPU_ENV].strip()
        return [parse_bytes(x, GPU_ENV) for x in text.split(",")] if text else None
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        free = [int(float(x)) * 2**20 for x in out.split()]  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and free:
        try:
            free = [free[int(i)] for i in visible.split(",") if i.strip()]
        except (ValueError, IndexError):
            return None  # UUIDs or a list the driver does not have: not read here
    return free or None


def disk_free(path: str | Path) -> int | None:
    """Free bytes on the file system that holds `path` (or would: its nearest existing folder)."""
    if DISK_ENV in os.environ:
        return parse_bytes(os.environ[DISK_ENV], DISK_ENV)
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None
