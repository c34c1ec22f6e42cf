"""The simulator's op order must be the order torch.distributed.pipelining executes.

We run torch's own schedule code (`_step_microbatches` of the installed torch) with fake
stage objects that only record which compute call happens, one rank at a time: no process
group, no tensors. If torch changes a schedule, or our port drifts, these tests fail.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as tsched  # noqa: E402

from dynmo.engine.schedules import Op, ScheduleError, build_plan  # noqa: E402


class FakeStage:
    """The attributes and methods torch's schedules touch, recording compute calls."""

    def __init__(self, stage_index: int, num_stages: int, group_rank: int, group_size: int, log: list):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_rank = group_rank
        self.group_size = group_size
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.has_backward = True
        self.stage_index_to_group_rank = {}
        self.output_chunks = []
        self._log = log

    # compute: the only thing we record
    def forward_one_chunk(self, mb, *args, **kwargs):
        self._log.append(Op("F", self.stage_index, mb))
        return None

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
        self._log.append(Op("B" if full_backward else "I", self.stage_index, mb))

    def backward_weight_one_chunk(self, mb, last_backward=False):
        self._log.append(Op("W", self.stage_index, mb))

    # communication and bookkeeping: no-ops
    def get_fwd_recv_ops(self, mb): return []
    def get_fwd_send_ops(self, mb): return []
    def get_bwd_recv_ops(self, mb): return []
    def get_bwd_send_ops(self, mb): return []
    def perform_reduce_grad(self, scale): pass
    def set_local_fwd_input(self, x, mb): pass
    def set_local_bwd_input(self, x, mb): pass
    def get_local_bwd_output(self, mb): return None
    def clear_runtime_states(self): pass


TORCH_CLASSES = {
    "GPipe": tsched.ScheduleGPipe,
    "1F1B": tsched.Schedule1F1B,
    "Interleaved1F1B": tsched.ScheduleInterleaved1F1B,
    "LoopedBFS": tsched.ScheduleLoopedBFS,
    "InterleavedZeroBubble": tsched.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": tsched.ScheduleZBVZeroBubble,
}


def torch_rank_order(name: str, ranks: int, microbatches: int, stages_per_rank: int) -> list[list[Op]]:
    """Run torch's schedule for every rank with fake stages; return the compute calls made."""
    cls = TORCH_CLASSES[name]
    num_stages = ranks * stages_per_rank
    orders = []
    for rank in range(ranks):
        log: list[Op] = []
        if stages_per_rank == 1 and name in ("GPipe", "1F1B"):
            sched = cls(FakeStage(rank, num_stages, rank, ranks, log), microbatches)
            sched._initialize_stage = lambda *a, **k: None
        else:
            if name == "ZBVZeroBubble":
                idx = [rank, num_stages - 1 - rank]
            else:
                idx = list(range(rank, num_stages, ranks))
            stages = [FakeStage(s, num_stages, rank, ranks, log) for s in idx]
            sched = cls(stages, microbatches)
            sched._initialize_stages = lambda *a, **k: None
        sched._step_microbatches()
        orders.append(log)
    return orders


def torch_pipeline_order(name: str, ranks: int, microbatches: int, stages_per_rank: int) -> list[list[Op]]:
    """torch's declared `pipeline_order` IR (compute actions only), for cross-checking."""
    cls = TORCH_CLASSES[name]
    num_stages = ranks * stages_per_rank
    if name in ("GPipe", "1F1B"):
        sched = cls(FakeStage(0, num_stages, 0, ranks, []), microbatches)
    else:
        idx = [0, num_stages - 1] if name == "ZBVZeroBubble" else list(range(0, num_stages, ranks))
        sched = cls([FakeStage(s, num_stages, 0, ranks, []) for s in idx], microbatches)
    out = []
    for rank in range(ranks):
        acts = [a for a in sched.pipeline_order[rank] if a is not None and a.is_compute_op]
        out.append([Op(a.computation_type.value, a.stage_index, a.microbatch_index) for a in acts])
    return out


SINGLE_CASES = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 4, 5, 8, 12)]
MULTI_CASES = [(p, m, v) for p in (2, 3, 4) for m in (2, 4, 6, 8, 12) for v in (2, 3)]


def _valid_for_torch(name: str, p: int, m: int) -> bool:
    if name == "1F1B" and m < p:
        return False  # torch refuses
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // p) != 0:
        return False
    return True


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", SINGLE_CASES)
def test_single_stage_order_matches_torch_execution(name, p, m):
    if not _valid_for_torch(name, p, m):
        pytest.skip("torch rejects this shape")
    ours = [list(ops) for ops in build_plan(name, p, m).rank_ops]
    assert ours == torch_rank_order(name, p, m, 1)


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"])
@pytest.mark.parametrize("p,m,v", MULTI_CASES)
def test_multi_stage_order_matches_torch_execution(name, p, m, v):
    if not _valid_for_torch(name, p, m):
        pytest.skip("torch rejects this shape")
    ours = [list(ops) for ops in build_plan(name, p, m, stages_per_rank=v).rank_ops]
    assert ours == torch_rank_order(name, p, m, v)


@pytest.mark.parametrize("p,m", [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 7, 8, 12)])
def test_zbv_order_matches_torch_execution(p, m):
    ours = [list(ops) for ops in build_plan("ZBVZeroBubble", p, m, stages_per_rank=2).rank_ops]
    assert ours == torch_rank_order("ZBVZeroBubble", p, m, 2)


@pytest.mark.parametrize(
    "name,p,m,v",
    # Not 1F1B: in torch 2.13 its `_get_pipeline_order` IR numbers the last rank's forwards
    # from 1 (an IR-only bug; `_step_microbatches`, tested above, is what runs).
    [("GPipe", 4, 8, 1), ("Interleaved1F1B", 4, 8, 2),
     ("InterleavedZeroBubble", 3, 6, 2), ("ZBVZeroBubble", 4, 8, 2), ("LoopedBFS", 2, 4, 3)],
)
def test_order_matches_torch_pipeline_order_ir(name, p, m, v):
    """torch's declared IR agrees with what its runtime executes (and with us)."""
    ours = [list(ops) for ops in build_plan(name, p, m, stages_per_rank=v).rank_ops]
    assert ours == torch_pipeline_order(name, p, m, v)


def test_torch_1f1b_first_rank_warms_up_with_p_forwards():
    # Documented quirk: torch's 1F1B runs p (not p-1) forwards on rank 0 before the first B.
    ops = build_plan("1F1B", 4, 8).rank_ops[0]
    assert [o.kind for o in ops[:5]] == ["F", "F", "F", "F", "B"]


def test_bad_shapes_explain_themselves():
    with pytest.raises(ScheduleError, match="multiple of the number of rounds"):
        build_plan("Interleaved1F1B", 4, 10 + 1)
    with pytest.raises(ScheduleError, match="exactly 2"):
        build_plan("ZBVZeroBubble", 2, 4, stages_per_rank=3)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_plan("pipedream", 2, 4)
