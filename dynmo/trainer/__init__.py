"""The training loop every rank runs: `Trainer` (`dynmo.train` builds and runs it).

    dynmo.trainer.core      `Trainer`: the step loop, validation, checkpoints, the run's end
    dynmo.trainer.setup     its set-up: data, resume, probes, the DynMo loop
    dynmo.trainer.changes   what changes before a step: re-layouts, expert re-placements, grows
    dynmo.trainer.log       what rank 0 writes: metrics, trace, summary
"""
from dynmo.trainer.core import Trainer

__all__ = ["Trainer"]
