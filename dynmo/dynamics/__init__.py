"""Dynamic-model cases: plug-ins that change the model while it trains, or watch it change.

    case.py        the plug-in interface (`Case`) and the narrow view of the run it gets (`Host`)
    registry.py    `CASES`: every case, in the order they run
    blockstats.py  per-layer statistics of the dynamic blocks (MoE, MoD, hash attention)
    skew.py        injected, known imbalance (extra MLP work, math unchanged)
    earlyexit.py   CALM-style early exit of tokens
    freeze.py      Egeria-style layer freezing
    prune.py       gradual global magnitude pruning (topk.py: the distributed global top-k;
                   prunekernel.py: each pruned block's kernel, masked dense or CSR)

The dynamic *blocks* (MoE, Mixture of Depths, hash attention) are model code: `dynmo.model`.
"""
