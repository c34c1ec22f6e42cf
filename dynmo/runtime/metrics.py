"""Per-step metrics on the logging rank: one console line, metrics.jsonl, TensorBoard, a bar.

metrics.jsonl holds one JSON object per step; see docs/metrics.md for every field.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dynmo.record import StepRecord


def _truncate_from(path: Path, step: int) -> None:
    """Keep the rows of steps before `step` (a resumed run writes the later ones again); the
    file is replaced in one rename, so a kill leaves either the old rows or the kept ones."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class MetricsLog:
    def __init__(self, out: Path, total_steps: int, start_step: int, tensorboard: bool, progress: bool, every: int):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        path = out / "metrics.jsonl"
        if start_step and path.exists():
            _truncate_from(path, start_step)
        self.jsonl = open(path, "a" if start_step else "w")
        self.every = max(1, every)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # a resumed run drops the events of steps it trains again
                self.tb = SummaryWriter(str(out / "tb"), purge_step=start_step or None)
            except Exception as e:  # tensorboard missing or broken: keep training, say so once
                print(f"dynmo: tensorboard disabled ({e})", file=sys.stderr, flush=True)
        self.bar = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, rec: StepRecord) -> None:
        self.jsonl.write(json.dumps(rec.to_json()) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k in ("loss", "tokens_per_s", "bubble_ratio", "imbalance", "grad_norm", "lr", "val_loss"):
                if getattr(rec, k) is not None:
                    self.tb.add_scalar(k, getattr(rec, k), rec.step)
            for j, v in enumerate(rec.stage_compute_s):
                self.tb.add_scalar(f"stage_compute_s/{j}", v, rec.step)
        line = self.format(rec)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {rec.loss:.4f}")
            if rec.step % self.every == 0 or rec.events:
                self.bar.write(line)
        elif rec.step % self.every == 0 or rec.events:
            print(line, flush=True)

    @staticmethod
    def format(rec: StepRecord) -> str:
        s = (
            f"step {rec.step:>5} | loss {rec.loss:.4f} | {rec.tokens_per_s:>8.0f} tok/s | "
            f"bubble {rec.bubble_ratio:.3f} | imbalance {rec.imbalance:.3f} | {rec.layout_str}"
        )
        if rec.val_loss is not None:
            s += f" | val {rec.val_loss:.4f}"
        for ev in rec.events:
            if ev["type"] == "migration":
                s += f"\n      migrated {ev['layers_moved']} unit{'' if ev['layers_moved'] == 1 else 's'} {ev['old']} -> {ev['new']} ({ev['bytes'] / 1e6:.2f} MB, {ev['seconds'] * 1e3:.1f} ms)"
            elif ev["type"] == "grow":
                s += (f"\n      grew {ev['stages'][0]} -> {ev['stages'][1]} stages {ev['old']} -> {ev['new']} by a restart "
                      f"({ev['restart_s']:.1f} s from the decision: checkpoint {ev['checkpoint_s']:.2f} s, "
                      f"set-up {ev['setup_s']:.2f} s, the rest ending and launching the job)")
            else:
                s += f"\n      {ev['type']}: " + ", ".join(f"{k}={v}" for k, v in ev.items() if k != "type")
        return s

    def close(self, summary: dict | None) -> None:
        """Write `summary.json` (None: the run goes on in a restarted job, which writes it) and close."""
        if summary is not None:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
