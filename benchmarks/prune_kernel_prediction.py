"""How well pruned Linears' kernel times are predicted from their mask features, on a real run.

Produces the table in docs/bench/prune-kernel-prediction.md (linked from docs/tensors.md, "Pruned
weights").

    dynmo train --nproc 2 --config configs/pruning.toml --out runs/pruning --overwrite
    python benchmarks/prune_kernel_prediction.py runs/pruning [runs/other ...]

At every pruning step with `prune.kernel = auto`, each block's masked dense and CSR times are
first predicted by `dynmo.tensor.matrix.KernelModel` from the new masks' features (fitted on
the measurements of the run's earlier pruning steps) and then measured; both go into the
metrics (prune_dense_pred_ms / prune_csr_pred_ms beside prune_dense_ms / prune_csr_ms). This
prints, per run and pruning step, the blocks' median and worst relative error of each
prediction and of the ratio csr / dense (which decides the kernel, and which a machine that is
slower or faster as a whole does not move), and for how many blocks the predicted times pick
the kernel the measurement chose.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def rows(run: Path):
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for r in recs:
        if not any(e.get("type") == "dynamism" and e.get("case") == "prune" for e in r["events"]):
            continue
        pred_d, pred_c = r.get("prune_dense_pred_ms"), r.get("prune_csr_pred_ms")
        meas_d, meas_c = r.get("prune_dense_ms"), r.get("prune_csr_ms")
        if not pred_d or meas_d is None:
            yield r["step"], None
            continue
        blocks = [i for i, v in enumerate(pred_d) if v is not None and meas_d[i] is not None]
        err_d = [abs(pred_d[i] - meas_d[i]) / meas_d[i] for i in blocks]
        err_c = [abs(pred_c[i] - meas_c[i]) / meas_c[i] for i in blocks]
        # the ratio csr / dense decides the kernel, and a machine that is slower or faster as a
        # whole than when the model was fitted (another job, clocks) changes both times, not it
        err_r = [abs((pred_c[i] / pred_d[i]) / (meas_c[i] / meas_d[i]) - 1) for i in blocks]
        same = sum((pred_c[i] < pred_d[i]) == (meas_c[i] < meas_d[i]) for i in blocks)
        yield r["step"], (statistics.median(err_d), max(err_d), statistics.median(err_c), max(err_c),
                          statistics.median(err_r), max(err_r), same, len(blocks))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    print(f"{'run':<24} {'step':>4} {'dense err med':>13} {'max':>6} {'csr err med':>11} {'max':>6} "
          f"{'ratio err med':>13} {'max':>6} {'same kernel':>11}")
    for arg in argv:
        run = Path(arg)
        for step, r in rows(run):
            if r is None:
                print(f"{run.name:<24} {step:>4} {'(no model yet: first measured step)':>54}")
                continue
            ed, ed_max, ec, ec_max, er, er_max, same, n = r
            print(f"{run.name:<24} {step:>4} {ed:>13.1%} {ed_max:>6.1%} {ec:>11.1%} {ec_max:>6.1%} {er:>13.1%} "
                  f"{er_max:>6.1%} {same:>6} of {n:<2}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
