"""A worker's peak memory over one step, measured (beside the estimate the balancer uses).

CUDA   the caching allocator's peak of allocated bytes (`torch.cuda.max_memory_allocated`),
       reset at the start of the step: tensors only.
CPU    the process's peak resident set size over the step: Linux keeps it as `VmHWM` in
       /proc/self/status and resets it to the current size on a write of "5" to
       /proc/self/clear_refs. It counts everything resident -- tensors, the Python heap, the
       libraries, the token data, and memory the C allocator keeps after a free -- so it is an
       upper bound on the tensors' peak, and comparable between runs of one program (e.g. with
       and without activation checkpointing). Where /proc cannot do this (not Linux, or a
       sandbox that forbids the write) the peak is 0: unknown, never a guess.
"""

from __future__ import annotations

import re

import torch

_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)


class PeakMemory:
    """`reset()` before the step, `peak()` after it: bytes, 0 if this platform cannot say."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu_ok = device.type != "cuda" and _reset_rss()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.cpu_ok:
            self.cpu_ok = _reset_rss()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return _peak_rss() if self.cpu_ok else 0


def _reset_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _peak_rss() > 0
    except OSError:
        return False


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            m = _HWM.search(f.read())
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0
