"""A run folder (`--out`): what it holds, which checkpoints in it are complete, whether a new
run may write into it. Pure (no torch): the launcher calls it before any process starts.

A run folder holds `config.toml`, `metrics.jsonl`, `summary.json`, `tb/`, checkpoints
`checkpoint-STEP` / `checkpoint-final` and, after a failed run, `errors/rank-N.txt` (a rank's
full traceback, `dynmo.runtime.failures`). A checkpoint is written into a hidden temporary
folder (`.checkpoint-STEP.tmp`) with its `dynmo.json` last and renamed into place when every
rank has finished (`dynmo.runtime.checkpoint`), so a folder named `checkpoint-*` that holds a
readable `dynmo.json` is complete; anything else (a temporary folder a kill left behind) is
ignored and cleaned up by the next save.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from dynmo.config import ConfigError

CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+|final)")
RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "tb", "errors")
LATEST = "latest"


def checkpoint_step(path: Path) -> int | None:
    """The step a complete checkpoint was saved at, or None if `path` is not one."""
    if not CHECKPOINT_NAME.fullmatch(path.name) or not path.is_dir():
        return None
    try:
        meta = json.loads((path / "dynmo.json").read_text())
        return int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints in `out`, oldest first (by step; `checkpoint-final` after a numbered
    one of the same step)."""
    if not out.is_dir():
        return []
    found = [(s, p.name == "checkpoint-final", p) for p in out.iterdir() if (s := checkpoint_step(p)) is not None]
    return [p for _, _, p in sorted(found)]


def latest_checkpoint(out: Path) -> Path | None:
    done = complete_checkpoints(out)
    return done[-1] if done else None


def resolve_resume(resume: str, out: str, verify: Callable[[str], None] = lambda path: None) -> tuple[str, str]:
    """The checkpoint to resume from and a note for the user ("" if none).

    `verify(path)` raises ConfigError for a checkpoint that cannot be resumed. An explicit
    folder must pass it. `latest` is the newest complete checkpoint of the run folder that
    passes: a newer one that fails (a shard cut short, say) is skipped, and the note names it
    and why, so a damaged last save costs the steps since the one before it, not the run."""
    if resume != LATEST:
        verify(resume)
        return resume, ""
    done = complete_checkpoints(Path(out))
    if not done:
        raise ConfigError(f"checkpoint.resume = latest, but the run folder {out!r} holds no complete checkpoint; "
                          "start without --checkpoint.resume, or name a checkpoint folder")
    failed: list[tuple[Path, str]] = []
    for path in reversed(done):
        try:
            verify(str(path))
        except ConfigError as e:
            failed.append((path, str(e)))
            continue
        return str(path), _skipped_note(failed, path)
    newest, why = failed[0]
    raise ConfigError(f"checkpoint.resume = latest, but no checkpoint in {out!r} can be resumed; the newest, "
                      f"{newest.name}: {why}")


def _skipped_note(failed: list[tuple[Path, str]], chosen: Path) -> str:
    if not failed:
        return ""
    names = " and ".join(p.name for p, _ in failed)
    fail = "fails its" if len(failed) == 1 else "fail their"
    return (f"checkpoint.resume = latest: skipping {names}, which {fail} checks ({failed[0][1]}); "
            f"resuming from {chosen}, the newest checkpoint that passes")


def run_contents(out: Path) -> list[str]:
    """What a run left in `out` (its files and checkpoints, temporary ones included), sorted."""
    if not out.is_dir():
        return []
    names = []
    for p in out.iterdir():
        bare = p.name.removeprefix(".").removesuffix(".tmp").removesuffix(".old")
        if p.name in RUN_FILES or CHECKPOINT_NAME.fullmatch(bare):
            names.append(p.name)
    return sorted(names)


def check_run_folder(out: str, resume: str, overwrite: bool) -> None:
    """Refuse to write a new run into a folder that holds one, unless the run resumes from a
    checkpoint inside it or the user asked to overwrite. Raises ConfigError naming the ways on."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--out {out!r} is a file, not a folder; choose a folder for the run")
    if overwrite or not folder.is_dir() or not any(folder.iterdir()):
        return
    if resume and Path(resume).resolve().parent == folder.resolve():
        return  # continuing this run: metrics continue from the resumed step
    held = run_contents(folder) or sorted(p.name for p in folder.iterdir())
    shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    raise ConfigError(
        f"the run folder {out!r} is not empty ({shown}); continue that run with --checkpoint.resume latest, "
        "choose a new --out, or pass --overwrite to replace it"
    )


def clear_run(out: str) -> None:
    """`--overwrite`: remove what an earlier run wrote into `out` (its metrics, summary,
    TensorBoard events and checkpoints); other files in the folder stay."""
    folder = Path(out)
    for name in run_contents(folder):
        p = folder / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
