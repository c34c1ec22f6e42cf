"""Kill `dynmo data prepare` with SIGKILL at random points, resume it, compare with an uninterrupted run.

    python benchmarks/kill_resume.py --ref REF_DIR --out OUT_DIR --duration S [--kills 2] [--seed 0] \
        -- dynmo data prepare SRC... --tokenizer T --out OUT_DIR [...]

REF_DIR is the same preparation finished without interruption; S about how long it took.
OUT_DIR is deleted first. The command then runs in a process group of its own, and at a time
drawn uniformly from 10-90 % of S (the seeded generator's) the whole group gets SIGKILL; what the
folder holds at that moment is printed (finished shards, .part and .claim files). This repeats
`--kills` times, each restart resuming the folder, its kill drawn from 10-90 % of what is left
of S (a restart skips the finished shards); a last run finishes it. Every file in both
folders is then compared by SHA-256: all but manifest.json must be byte-identical (the manifest
is compared and printed too). Exits 0 when they are.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def digests(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.iterdir()):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        out[p.name] = h.hexdigest()
    return out


def held(folder: Path) -> str:
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    done = sum(n.endswith(".json") and n.startswith("shard-") for n in names)
    parts = sorted(n for n in names if n.endswith(".part"))
    claims = sorted(n for n in names if n.endswith(".claim"))
    return f"{done} finished shards, .part: {parts or 'none'}, .claim: {claims or 'none'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command to run")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the command after --")
    out, ref = Path(a.out), Path(a.ref)
    shutil.rmtree(out, ignore_errors=True)
    rng = random.Random(a.seed)
    left = a.duration  # about what the job has still to do: a restart skips the finished shards
    for k in range(a.kills):
        at = rng.uniform(0.1, 0.9) * left
        left -= at
        child = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t = time.perf_counter()
        while child.poll() is None and time.perf_counter() - t < at:
            time.sleep(0.05)
        if child.poll() is not None:
            print(f"run {k + 1}: finished before its kill at {at:.1f} s (exit {child.returncode})", file=sys.stderr)
            continue
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        time.sleep(0.2)
        print(f"run {k + 1}: process group SIGKILLed at {at:.1f} s; the folder holds {held(out)}", file=sys.stderr)
    t = time.perf_counter()
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    print(f"last run: exit {rc} after {time.perf_counter() - t:.1f} s", file=sys.stderr)
    mine, theirs = digests(out), digests(ref)
    names = sorted(set(mine) | set(theirs))
    differ = [n for n in names if mine.get(n) != theirs.get(n)]
    files = [n for n in names if n != "manifest.json"]
    same = [n for n in files if n not in differ]
    print(f"{len(same)} of {len(files)} files other than manifest.json byte-identical "
          f"({sum((out / n).stat().st_size for n in same if (out / n).exists()) / 1e6:.1f} MB); "
          f"manifest.json {'identical' if 'manifest.json' not in differ else 'differs'}; "
          f"differing: {[n for n in differ if n != 'manifest.json'] or 'none'}", file=sys.stderr)
    return 0 if rc == 0 and not [n for n in differ if n != "manifest.json"] else 1


if __name__ == "__main__":
    sys.exit(main())
