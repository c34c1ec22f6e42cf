"""The pruning case's kernel per block (`dynmo.dynamics.prune`): masked dense or CSR, picked by
measurement after every pruning step (`prune.kernel = "auto"`) or fixed.

What the choice rests on is per layer: the kernel, the two kernels' measured times, the pruned
Linears' mask features and the times `KernelModel` predicted from those features before the
kernels ran. All of it is the block's, so it travels with a migrating block (`pack`, `unpack`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from dynmo.config import PruneConfig
from dynmo.dynamics.case import Host
from dynmo.dynamics.topk import group_sum
from dynmo.model.sparse import KERNELS, time_kernels
from dynmo.tensor.matrix import MATRIX_STATS, KernelModel, KernelSample, matrix_features


class KernelChoice:
    def __init__(self, host: Host, opts: PruneConfig, rows: int):
        self.host, self.opts = host, opts
        self.rows = rows  # tokens per microbatch: the timing input
        self.kernel: dict[int, str] = {}  # layer index -> chosen kernel (unstructured, after pruning)
        self.timings: dict[int, dict[str, float]] = {}
        # layer index -> the pruned Linears' mask features, in `names` order: rows then cols,
        # MATRIX_STATS each; and the kernel times the model predicted before they were measured
        self.features: dict[int, list[float]] = {}
        self.predicted: dict[int, dict[str, float]] = {}
        self.kernel_model = KernelModel()  # fitted on this rank's measurements, step after step

    def of(self, index: int) -> str:
        return self.kernel.get(index, "dense")

    def choose(self, blocks: dict[int, nn.Module], per_block: dict[int, dict[str, torch.Tensor]]) -> None:
        t = torch.zeros(self.host.num_layers, 4, dtype=torch.float64)  # dense, csr measured; predicted
        samples = []
        for i, ms in per_block.items():
            feats: list[float] = []
            predicted = self.opts.kernel == "auto" and all(self.kernel_model.ready(k) for k in KERNELS)
            for name, mask in ms.items():
                rows, cols = (int(d) for d in mask.shape)
                per_row = mask.sum(1).cpu().numpy()
                f = matrix_features(per_row, mask.sum(0).cpu().numpy())
                feats += [f[side][k] for side in ("rows", "cols") for k in MATRIX_STATS]
                if self.opts.kernel != "auto":
                    continue
                sample = KernelSample(rows, cols, int(per_row.sum()), int(per_row.max()), self.rows)
                if predicted:  # priced from the mask's features before the kernels run
                    t[i, 2] += self.kernel_model.predict(sample, "dense")
                    t[i, 3] += self.kernel_model.predict(sample, "csr")
                r = time_kernels(blocks[i].get_submodule(name), mask, self.rows, dtype=self.host.dtype)
                samples.append(replace(sample, seconds=r))
                t[i, 0] += r["dense"]
                t[i, 1] += r["csr"]
            self.features[i] = feats
            if predicted:
                self.predicted[i] = {"dense": float(t[i, 2]), "csr": float(t[i, 3])}
        if self.opts.kernel == "auto":
            self.kernel_model.add(samples)
            if self.host.replica_group is not None:  # replicas pick alike
                group_sum(t, self.host.replica_group)
                t /= self.host.replicas
        for i in per_block:
            if self.opts.kernel == "auto":
                self.kernel[i] = "csr" if t[i, 1] < t[i, 0] else "dense"
                self.timings[i] = {"dense": float(t[i, 0]), "csr": float(t[i, 1])}
            else:
                self.kernel[i] = self.opts.kernel

    def stats(self, i: int, out: dict[str, dict[int, Any]]) -> None:
        """Layer `i`'s kernel figures, added to `out` (`Prune.layer_stats`)."""
        out.setdefault("prune_kernel", {})[i] = float(self.of(i) == "csr")
        if i in self.timings:
            out.setdefault("prune_dense_ms", {})[i] = 1e3 * self.timings[i]["dense"]
            out.setdefault("prune_csr_ms", {})[i] = 1e3 * self.timings[i]["csr"]
        if i in self.predicted:
            out.setdefault("prune_dense_pred_ms", {})[i] = 1e3 * self.predicted[i]["dense"]
            out.setdefault("prune_csr_pred_ms", {})[i] = 1e3 * self.predicted[i]["csr"]
        if i in self.features:  # one list per statistic: a value per pruned Linear, `prunable` order
            n = len(MATRIX_STATS)
            for k, (side, stat) in enumerate((s, m) for s in ("rows", "cols") for m in MATRIX_STATS):
                out.setdefault(f"prune_{side}_{stat}", {})[i] = self.features[i][k::2 * n]

    def pack(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s figures as tensors, dropped here: the layer is leaving this rank."""
        out = {}
        if index in self.kernel:
            out["kernel"] = torch.tensor([KERNELS.index(self.kernel.pop(index))])
        if index in self.timings:
            tm = self.timings.pop(index)
            out["timings"] = torch.tensor([tm["dense"], tm["csr"]], dtype=torch.float64)
        if index in self.predicted:
            tm = self.predicted.pop(index)
            out["predicted"] = torch.tensor([tm["dense"], tm["csr"]], dtype=torch.float64)
        if index in self.features:
            out["features"] = torch.tensor(self.features.pop(index), dtype=torch.float64)
        return out

    def unpack(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        if "kernel" in tensors:
            self.kernel[index] = KERNELS[int(tensors["kernel"])]
        if "timings" in tensors:
            d, c = tensors["timings"].tolist()
            self.timings[index] = {"dense": d, "csr": c}
        if "predicted" in tensors:
            d, c = tensors["predicted"].tolist()
            self.predicted[index] = {"dense": d, "csr": c}
        if "features" in tensors:
            self.features[index] = tensors["features"].tolist()
