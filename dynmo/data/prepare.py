"""`dynmo data prepare`: sources -> a folder of token shards and its manifest.

    OUT/plan.json         what this folder is a preparation of (sources, field, tokenizer, shard
                          size), written first: a rerun with the same arguments resumes it
    OUT/tokenizer.json    the tokenizer it encodes with (the trained one for bpe:N)
    OUT/shard-NNNNN.*     the shards (dynmo.data.shards), written by `--workers` processes
    OUT/manifest.json     written last: sources, tokenizer hash, documents, tokens, shards and
                          their checksums; a folder without it is unfinished work

Every bad input is refused before anything is written. A run killed at any point and started
again with the same arguments keeps the finished shards, redoes the unfinished ones and ends
with the same bytes as an uninterrupted run, for any number of workers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import sys
from pathlib import Path
from queue import Empty

from dynmo.data import encode
from dynmo.data.corpus import DataError
from dynmo.data import room
from dynmo.data.manifest import FORMAT, MANIFEST, PLAN, TOKENIZER, read_manifest, write_json
from dynmo.data.shards import shard_name, token_dtype
from dynmo.data.sources import SourceFile, check_first, records, source_files
from dynmo.data.tokenizer import TokenizerInfo, from_file, resolve, tokenizer_hash

OWN_FILES = re.compile(r"^(plan\.json|tokenizer\.json|manifest\.json|shard-\d{5}\.(bin|idx|json|claim))(\.part)?$")
PROCESS_BYTES = 160 << 20  # a worker's own memory (interpreter, numpy, the tokenizer), before its batch
BYTES_PER_TEXT_BYTE = 120  # what encode_batch holds per byte of text (ids, offsets, token strings)


def _plan(files: list[SourceFile], field: str, tokenizer: str, shard_bytes: int) -> dict:
    tok = tokenizer if tokenizer.startswith("bpe:") else tokenizer_hash(from_file(tokenizer).blob.encode())
    return {"format": FORMAT, "field": field, "tokenizer": tok, "shard_bytes": shard_bytes,
            "sources": [{"path": str(f.path.resolve()), "kind": f.kind, "bytes": f.size,
                         "mtime_ns": f.path.stat().st_mtime_ns} for f in files]}


def _check_out(out: Path, plan: dict) -> str:
    """What `out` holds: "new", "resume" (this preparation's own partial work) or "done"."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; give a new or empty folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return "new"
    foreign = [e for e in entries if not OWN_FILES.match(e)]
    if foreign or PLAN not in entries:
        shown = ", ".join((foreign or entries)[:3])
        raise DataError(f"--out {out} holds files that are not a preparation's ({shown}); give a new or empty folder")
    try:
        theirs = json.loads((out / PLAN).read_text())
    except (OSError, ValueError):
        theirs = None
    if not isinstance(theirs, dict) or {k: v for k, v in theirs.items() if k != "eos"} != plan:
        raise DataError(f"--out {out} holds a preparation of other sources or another tokenizer (its {PLAN} differs); "
                        "give another --out, or delete that folder to prepare it again")
    return "done" if MANIFEST in entries else "resume"


def _tokenizer(out: Path, spec: str, files: list[SourceFile], field: str) -> TokenizerInfo:
    if (out / TOKENIZER).is_file():  # resuming: the tokenizer the first run wrote (bpe:N was trained once)
        info = from_file(str(out / TOKENIZER))
        eos = json.loads((out / PLAN).read_text()).get("eos")
        return TokenizerInfo(info.blob, eos if isinstance(eos, int) else info.eos, info.vocab_size)
    return resolve(spec, (r.text() for r in records(files, field)))


def batch_bytes(memory_gb: float, workers: int) -> int:
    """Text per encode_batch call so that `workers` workers stay within `memory_gb` together."""
    per = memory_gb * (1 << 30) / workers - PROCESS_BYTES
    if per < 8 * BYTES_PER_TEXT_BYTE * 1024:
        raise DataError(f"--memory-gb {memory_gb} is too little for {workers} workers (each needs about "
                        f"{(PROCESS_BYTES >> 20) + 1} MB); give more memory or fewer --workers")
    return int(min(8 << 20, per / BYTES_PER_TEXT_BYTE))


def prepare_folder(sources: list[str], tokenizer: str, out: str, field: str = "text", workers: int = 0,
                   memory_gb: float = 1.0, shard_mb: float = 64, max_vocab: int = 0, quiet: bool = False) -> dict:
    """Prepare `sources` into `out` (or finish a killed preparation of them); return the manifest."""
    files = source_files(sources)
    check_first(files, field)
    shard_bytes = int(shard_mb * (1 << 20))
    if shard_bytes < 1:
        raise DataError(f"--shard-mb must be > 0, got {shard_mb}")
    workers = workers or os.cpu_count() or 1
    plan = _plan(files, field, tokenizer, shard_bytes)
    folder = Path(out)
    state = _check_out(folder, plan)
    if state == "done":
        return read_manifest(folder)
    size = batch_bytes(memory_gb, workers)
    room.check_memory(memory_gb)
    info = _tokenizer(folder, tokenizer, files, field)
    if max_vocab and info.vocab_size > max_vocab:
        raise DataError(f"the tokenizer has {info.vocab_size} tokens, more than model.vocab_size {max_vocab}; "
                        "raise model.vocab_size or use a smaller tokenizer")
    room.check_disk(folder, files, field, info.blob, token_dtype(info.vocab_size).itemsize)
    created = state == "new"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if created:
            write_json(folder / PLAN, {**plan, "eos": info.eos})
            (folder / TOKENIZER).write_text(info.blob, encoding="utf-8")
        elif not (folder / TOKENIZER).is_file():
            (folder / TOKENIZER).write_text(info.blob, encoding="utf-8")
        _clear(folder)  # a killed run's unfinished files and claims
        jobs = [encode.Job(folder, files, field, info.blob, info.eos, info.vocab_size, shard_bytes, size, w, workers)
                for w in range(workers)]
        n = _run(jobs, sum(f.size for f in files), quiet)
        _clear(folder)
    except DataError:
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return _finish(folder, plan, info, n)


def _clear(folder: Path) -> None:
    for path in [*folder.glob("*.part"), *folder.glob("*.claim")]:
        path.unlink()


def _finish(folder: Path, plan: dict, info: TokenizerInfo, n: int) -> dict:
    shards = []
    for j in range(n):
        path = folder / f"{shard_name(j)}.json"
        if not path.is_file():
            raise DataError(f"{folder}: shard {j} was not finished; run the same command again to finish it")
        shards.append(json.loads(path.read_text()))
    manifest = {"format": FORMAT, "sources": plan["sources"], "field": plan["field"],
                "tokenizer": {"spec": plan["tokenizer"], "sha256": info.sha256, "eos": info.eos,
                              "vocab_size": info.vocab_size},
                "dtype": token_dtype(info.vocab_size).name, "docs": sum(s["docs"] for s in shards),
                "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    write_json(folder / MANIFEST, manifest)
    return manifest


def _worker(job: encode.Job, queue) -> None:
    try:
        n = encode.run(job, lambda t: queue.put(("progress", job.worker, t.read, t.docs, t.tokens)))
        queue.put(("done", job.worker, n))
    except DataError as e:
        queue.put(("error", job.worker, str(e)))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which fails with it)
        queue.put(("error", job.worker, f"worker {job.worker} failed: {type(e).__name__}: {e}"))


def _run(jobs: list[encode.Job], total: int, quiet: bool) -> int:
    """Run the workers (in this process when there is one) with one progress bar; the shard count."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet, file=sys.stderr,
               desc="dynmo data prepare", dynamic_ncols=True)
    seen: dict[int, tuple[int, int, int]] = {}

    def show(w: int, read: int, docs: int, tokens: int) -> None:
        seen[w] = (read, docs, tokens)
        bar.n = min(r for r, _, _ in seen.values()) if len(seen) == len(jobs) else 0
        bar.set_postfix(docs=sum(d for _, d, _ in seen.values()), tokens=sum(t for _, _, t in seen.values()),
                        refresh=False)
        bar.refresh()

    try:
        if len(jobs) == 1:
            return encode.run(jobs[0], lambda t: show(0, t.read, t.docs, t.tokens))
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(job, queue), daemon=True) for job in jobs]
        for p in procs:
            p.start()
        counts: dict[int, int] = {}
        try:
            while len(counts) < len(jobs):
                try:
                    msg = queue.get(timeout=1.0)
                except Empty:
                    dead = [w for w, p in enumerate(procs) if not p.is_alive() and w not in counts]
                    if dead and queue.empty():
                        raise DataError(f"worker {dead[0]} of dynmo data prepare died (exit status "
                                        f"{procs[dead[0]].exitcode}); run the same command again to resume") from None
                    continue
                if msg[0] == "progress":
                    show(*msg[1:])
                elif msg[0] == "done":
                    counts[msg[1]] = msg[2]
                else:
                    raise DataError(msg[2])
        finally:
            for p in procs:
                if p.is_alive() and len(counts) < len(jobs):
                    p.terminate()
                p.join()
        return counts[0]
    finally:
        bar.close()
