"""Which rank stopped responding: a heartbeat per rank in the job's key-value store.

Every rank runs a daemon thread that bumps a counter in torch.distributed's store (hosted by
torchrun's agent, so it outlives the workers) every `interval` seconds. A thread keeps beating while its rank waits inside a collective, and stops when
the process is stopped, killed or wedged outside Python. When a collective fails or times
out, `diagnose` reads the counters twice and names the ranks whose counter did not move:
no clocks are compared, so it holds across machines.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

PREFIX = "dynmo/heartbeat/"


def _store():
    return dist.distributed_c10d._get_default_store()


class Heartbeat:
    def __init__(self, rank: int, world: int, interval: float = 1.0):
        self.rank, self.world, self.interval = rank, world, interval
        self._seq = 0
        self._stop = threading.Event()
        self._store = _store()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="dynmo-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._seq += 1
        self._store.set(f"{PREFIX}{self.rank}", str(self._seq))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:
                return  # the store is gone: the job is ending

    def stop(self) -> None:
        self._stop.set()

    def _read(self) -> dict[int, int]:
        keys = [f"{PREFIX}{r}" for r in range(self.world)]
        seen = {}
        for r, k in enumerate(keys):
            if self._store.check([k]):
                seen[r] = int(self._store.get(k))
        return seen

    def diagnose(self) -> str:
        """'rank 1' (', rank 3', ...) for every rank whose heartbeat stopped, or '' if all beat."""
        try:
            first = self._read()
            time.sleep(3 * self.interval)
            second = self._read()
        except Exception:
            return ""
        silent = [r for r in range(self.world)
                  if r != self.rank and (r not in second or second[r] == first.get(r))]
        return ", ".join(f"rank {r}" for r in silent)
