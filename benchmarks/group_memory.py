"""Peak memory of a whole job, summed over its processes (docs/bench/data-prepare.md).

    python benchmarks/group_memory.py [--every 0.2] [--log FILE] -- COMMAND [ARG ...]

Starts COMMAND in a process group of its own and, every `--every` seconds until it ends, sums
the resident memory (RSS) and the proportional set size (PSS: a page shared by k processes
counts 1/k in each, so the sum counts it once) of every process in the group, read from
/proc/PID/smaps_rollup. Prints the peaks of both sums, the most processes seen at once and the
wall time, and exits with COMMAND's exit status. A sampler misses a peak shorter than its
interval; the job's own workers (spawned processes of the group) are all counted.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _group(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def _rollup(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes, or (0, 0) for a process that has gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=0.2)
    p.add_argument("--log", default="", help="also append the result line to this file")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command to run")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the command after --")
    t = time.perf_counter()
    child = subprocess.Popen(cmd, start_new_session=True)
    peak_rss = peak_pss = most = samples = 0
    try:
        while child.poll() is None:
            pids = _group(child.pid)
            sums = [_rollup(pid) for pid in pids]
            peak_rss = max(peak_rss, sum(r for r, _ in sums))
            peak_pss = max(peak_pss, sum(p for _, p in sums))
            most = max(most, len(pids))
            samples += 1
            time.sleep(a.every)
    except KeyboardInterrupt:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    wall = time.perf_counter() - t
    line = (f"group peak: RSS sum {peak_rss / 2**20:.0f} MiB, PSS sum {peak_pss / 2**20:.0f} MiB, "
            f"{most} processes at most, {samples} samples, {wall:.1f} s wall, exit {child.returncode}")
    print(line, file=sys.stderr)
    if a.log:
        with open(a.log, "a") as f:
            f.write(" ".join(cmd) + "\n" + line + "\n")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
