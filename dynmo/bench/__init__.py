"""`dynmo bench`: the headline benchmark (`dynmo.bench.cli` says what it runs and writes).

    cases     the cases, their shapes and dense models, the paper's figures
    run       the real runs of every variant; measures: what is read from their records
    sim       the paper-scale replays, and whole blocks against half blocks (`units_rows`);
              render: bench.md; plots: the real runs' plots
"""

from dynmo.bench import cli, run
from dynmo.bench.cases import CASES, PAPER, BenchCase
from dynmo.bench.cli import main
from dynmo.bench.measures import oracle_bound, overhead_s, per_worker, profile_once_of, throughput, worker_seconds
from dynmo.bench.render import render
from dynmo.bench.run import dense_name, real_row

__all__ = [
    "CASES", "PAPER", "BenchCase", "cli", "dense_name", "main", "oracle_bound", "overhead_s", "per_worker",
    "profile_once_of", "real_row", "render", "run", "throughput", "worker_seconds",
]
