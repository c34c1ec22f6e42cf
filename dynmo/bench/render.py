"""`bench.md`: the benchmark's rows as markdown tables."""

from __future__ import annotations

from dynmo.bench.cases import PAPER, STATIC_VARIANTS
from dynmo.sim.replay import PROFILE_STEPS


def fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def _f(x, spec: str = ".3f") -> str:
    return fmt(x, spec)


UNITS_LABEL = "whole blocks against half blocks (simulated)"


def experts_section(rows: list[dict]) -> list[str]:
    """The MoE cases replayed with expert parallelism, layout and placement decided together."""
    lines = [
        "## Expert parallelism at paper scale (the MoE traces above, scaled; `dynmo.sim.replay.expert_policies`)\n",
        "Each stage's experts spread over its E data-parallel replicas (tokens to their expert's rank and back by "
        "all-to-all, no padding); one decision for the layer layout and the placements. static: experts in index "
        "order on the best static layer layout in hindsight; dynmo: the trainer's decisions on the replayed steps "
        "(`balance.experts = \"auto\"` scored by the simulated step time, the layer controller from the FLOP "
        "model's layout); oracle: each step's best placements and layout, free to change. With an extra slot a rank "
        "(`parallel.expert_slots`), dynmo starts with copies in the extra slots and may copy hot experts, and so may "
        "the oracle; static never copies. Speedups are total time "
        "over static's; capture = (dynmo - 1) / (oracle - 1); dynmo over its start: over its first layout and "
        "placement left static; busiest / mean: the busiest EP rank's tokens over "
        "the mean rank's, mean over steps and MoE layers.\n",
        "| case | shape | E (experts) | extra slots | best static layout | static s | dynmo | capture | oracle "
        "| dynmo over its start | re-placements, layer migrations | busiest / mean: static, dynmo, oracle |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        busy = ", ".join(_f(r["busiest_over_mean"].get(p)) for p in ("static", "dynmo", "oracle"))
        lines.append(f"| {r['case']} | {r['shape']} | {r['ep']} ({r['experts']}) | {r.get('extra_slots', 0)} | "
                     f"{r['best_static']} | "
                     f"{_f(r['static_s'], ',.1f')} | {_f(r['dynmo'])} | {_f(r['capture'], '.2f')} | {_f(r['oracle'])} | "
                     f"{_f(r.get('dynmo_vs_start'))} | "
                     f"{r['replacements']}, {r['layer_migrations']} | {busy} |")
    return lines + [""]


def units_section(rows: list[dict]) -> list[str]:
    """The section of whole blocks against half blocks: per sublayer trace, a block row (the
    reference) and a sublayer row (`replay_units`' rows)."""
    lines = ["## Whole blocks against half blocks (replay)\n"]
    if not rows:
        return lines + [
            "Skipped: no sublayer trace in `traces/sublayer/` was replayed (record one with `dynmo train ... "
            "--parallel.unit sublayer --trace OUT/traces/sublayer/NAME.jsonl`; the repository's are in "
            "docs/bench/traces/sublayer/).\n"]
    lines += [
        "Each sublayer trace in `traces/sublayer/` (a run recorded with `--parallel.unit sublayer`: "
        "each block's attention half and MLP half are two placement units) scaled noise-free to the shape's "
        "blocks and replayed twice (`dynmo.sim.replay.replay_units`): as half blocks (`sublayer`), and merged into "
        "whole blocks (`block`, `merge_units` of the same scaled trace: the same per-step costs, only where a "
        "stage boundary may fall differs). Best static: the fastest of uniform, params and profile-once, and its "
        "total seconds. Balance gap: per step, the slowest stage of the optimal contiguous layout over the "
        "step's total cost / stages, median over the run's second half (1 is a perfect split). dynmo: "
        "`optimal`, `balance.when = auto`, from uniform, migrations and decide time included; oracle: each "
        "step's fastest layout, changed for free; both as the best static total over theirs (> 1: faster than "
        "the best static layout). Half blocks' speedup: the block row's total over the sublayer row's, for the "
        "best static layout, dynmo and the oracle (> 1: half blocks are faster). `python "
        "benchmarks/replay_units.py TRACE.jsonl` prints the same replay with total seconds.\n",
        "| trace | shape | units | layers | best static | best static s | balance gap | dynmo vs best static "
        "| dynmo migrations | oracle vs best static | half blocks' speedup (best static, dynmo, oracle) |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    ref: dict = {}
    for r in rows:
        if r["units"] == "block":
            ref = r
            vs = "reference"
        else:
            same = ref.get("trace") == r["trace"]
            vs = ", ".join(_f(ref[k] / r[k] if same and r.get(k) else None)
                           for k in ("best_static_s", "dynmo_s", "oracle_s"))
        lines.append(f"| {r['trace']} | {r['shape']} | {r['units']} | {r['layers']} | {r['best_static']} | "
                     f"{_f(r['best_static_s'], ',.1f')} | {_f(r['gap'])} | {_f(r.get('dynmo_vs_best_static'))} | "
                     f"{r['migrations']} | {_f(r.get('oracle_vs_best_static'))} | {vs} |")
    return lines + [""]


def render(real: list[dict], sim: list[dict], missing: list[str], argv: list[str], started: str = "",
           duration_s: float | None = None, units: list[dict] | None = None, experts: list[dict] | None = None) -> str:
    """bench.md. `units`: the rows of whole blocks against half blocks (`dynmo.bench.sim.units_rows`);
    None leaves their section out (never replayed), [] leaves a one-line note (no trace replayed).
    `experts`: the MoE cases' expert-parallel rows (`dynmo.bench.sim.expert_rows`)."""
    lines = ["# dynmo bench\n", f"Command: `dynmo bench {' '.join(argv)}`"
             + (f" (started {started}" + (f", {duration_s / 60:.0f} min" if duration_s else "") + ")" if started else "")
             + "\n"]
    runs: dict[tuple, list[str]] = {}
    for kind, rows in (("real", real), ("simulated", sim), ("units", units or [])):
        for r in rows:
            ran = r.get("run") or {}
            if ran and (ran.get("command") != argv or ran.get("started") != started):
                key = (" ".join(ran.get("command") or ["..."]), ran.get("started") or "?")
                label = UNITS_LABEL if kind == "units" else f"{r['case']} ({kind})"
                if label not in runs.setdefault(key, []):
                    runs[key].append(label)
    for (cmd, when), labels in runs.items():
        lines.append(f"Kept from an earlier invocation, `dynmo bench {cmd}` (started {when}): {', '.join(labels)}.\n")
    if real:
        lines += [
            "## Real runs, this machine (2 ranks, gloo, CPU)\n",
            "Tokens/s of every variant, one run each (all steps but the first, migrations included): these runs pick "
            "the best of the three static layouts (profile-once: the optimal layout for the uniform run's costs of "
            f"steps 1..{PROFILE_STEPS}, kept). The headline comes from other runs: alternating pairs of that best "
            "static layout and dynmo, the median of their tokens/s ratios and a distribution-free interval for it "
            "(coverage in brackets). An interval holding 1.0 is no measurable difference, neither a gain nor a loss.\n",
            "| case | trigger | steps | uniform | params | profile-once | dynmo | best static | **dynmo / best static "
            "(pairs)** | verdict | dynmo / uniform (unpaired) | oracle bound | migrations | overhead % | final layout |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---|",
        ]
        for r in real:
            t = r["tokens_per_s"]
            head = f"**{r['speedup_vs_best_static']:.3f}**"
            if r.get("interval"):
                lo, hi = r["interval"]
                head += f" ({lo:.3f}–{hi:.3f}, {100 * r['interval_coverage']:.0f}%, {r['pairs']} pairs)"
            lines.append(
                f"| {r['case']} | {r['when']} | {r['steps']} | {t['uniform']:,.0f} | {t['params']:,.0f} | "
                f"{t['profile-once']:,.0f} | {t['dynmo']:,.0f} | {r['best_static']} | {head} | "
                f"{r.get('verdict', 'unpaired')} | {r['speedup_vs_uniform']:.3f} | {r['oracle_bound']:.3f} | "
                f"{r['migrations']:g} | {r['overhead_pct']:.2f} | {r['final_layout']} |"
            )
        lines += [
            "",
            "### Technique alone and with dynmo, against the dense model and the paper\n",
            "Over the dense model (the same config without the technique, same steps): the technique on a static "
            "uniform layout, and with dynmo. Validation loss at the last step.\n",
            "| case | dense tok/s | technique alone | technique + dynmo | dynmo / best static | paper | paper compares against "
            "| val loss: dense → technique → + dynmo |",
            "|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in real:
            paper = PAPER.get(r["case"].split("-")[0])
            dn = r.get("dense") or {}
            v = r["val_loss"]
            lines.append(
                f"| {r['case']} | {_f(dn.get('tokens_per_s'), ',.0f')} | {_f(r.get('technique_alone'))} | "
                f"{_f(r.get('technique_dynmo'))} | {r['speedup_vs_best_static']:.3f} | "
                f"{f'{paper[0]:.2f}' if paper else 'n/a'} | {paper[1] if paper else 'n/a'} | "
                f"{_f(dn.get('val_loss'), '.3f')} → {_f(v.get('uniform'), '.3f')} → {_f(v.get('dynmo'), '.3f')} |"
            )
        packed = [r for r in real if "repack" in r["tokens_per_s"]]
        if packed:
            lines += [
                "",
                "### Re-packing: the same training on fewer workers\n",
                "Worker-seconds = sum over steps of the step's wall time x its active workers; tokens/s per worker is "
                "tokens over worker-seconds.\n",
                "| case | variant | workers (final) | tok/s | worker-seconds | tok/s per worker |",
                "|---|---|---:|---:|---:|---:|",
            ]
            for r in packed:
                for v in ("dynmo", "repack"):
                    lines.append(f"| {r['case']} | {'optimal' if v == 'dynmo' else 'optimal+repack'} | "
                                 f"{r['workers_final'][v]} | {r['tokens_per_s'][v]:,.0f} | {r['worker_s'][v]:,.0f} | "
                                 f"{r['tokens_per_worker_s'][v]:,.0f} |")
        lines.append("")
    if sim:
        lines += [
            "## Simulated at paper scale (uniform traces above, scaled; `dynmo.sim.replay`)\n",
            "Microbatches per replica = 4 x stages; migrations charged at the controller's cost model.\n",
            "Headline: total time of the best static layout (uniform, params or profile-once) over dynmo's, dynmo "
            "started from uniform, from profile-once and from flops (the FLOP model's layout, where a run starts "
            "when its config names no layout), over oracle-window's (one layout per window of "
            "`balance.window + balance.confirm` steps, chosen in hindsight, migrations charged: the bound of a "
            "controller that follows lasting changes) and over the oracle's (the fastest layout of every step in "
            "the simulation, free to change: no policy beats it). Settled: the same over the last half of the "
            "steps, against the static layout best there.\n",
            "| case | shape | best static | dynmo from uniform | dynmo from profile-once | dynmo from flops "
            "| oracle-window | oracle | settled: dynmo from uniform, from profile-once, from flops, oracle-window |",
            "|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        heads = {}
        for r in sim:
            heads.setdefault(r["case"], {})[r["policy"]] = r
        for c, pol in heads.items():
            anyrow = next(iter(pol.values()))
            settled = ", ".join(_f(pol.get(p, {}).get("speedup_vs_best_static_second_half"))
                                for p in ("optimal", "optimal from profile-once", "optimal from flops", "oracle-window"))
            lines.append(f"| {c} | {anyrow['shape']} | {anyrow.get('best_static') or 'n/a'} | "
                         f"{_f(pol.get('optimal', {}).get('speedup_vs_best_static'))} | "
                         f"{_f(pol.get('optimal from profile-once', {}).get('speedup_vs_best_static'))} | "
                         f"{_f(pol.get('optimal from flops', {}).get('speedup_vs_best_static'))} | "
                         f"{_f(pol.get('oracle-window', {}).get('speedup_vs_best_static'))} | "
                         f"{_f(pol.get('oracle', {}).get('speedup_vs_best_static'))} | {settled} |")
        lines += [
            "",
            "All policies. Second half: the same two ratios over the last half of the steps only (against the "
            "static layout best there). Captures: the share of the oracle's and oracle-window's gain over the best "
            "static layout a dynamic policy captures, in throughput, (vs best static - 1) / (the oracle's vs best "
            "static - 1); n/a where that oracle gains less than 0.5 %.\n",
            "| case | shape | policy | vs uniform | **vs best static** | second half: vs uniform, vs best static "
            "| captures oracle, oracle-window | vs dense | mean bubble | workers (final) "
            "| worker-seconds | per worker vs uniform | migrations |",
            "|---|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sim:
            dynamic = r["policy"] not in (*STATIC_VARIANTS, "oracle", "oracle-window")
            caps = ", ".join(_f(r.get(k)) for k in ("capture_oracle", "capture_oracle_window")) if dynamic else ""
            lines.append(
                f"| {r['case']} | {r['shape']} | {r['policy']} | {_f(r.get('speedup'))} | "
                f"{_f(r.get('speedup_vs_best_static'))} | {_f(r.get('speedup_second_half'))}, "
                f"{_f(r.get('speedup_vs_best_static_second_half'))} | {caps} | "
                f"{_f(r.get('vs_dense'))} | {_f(r.get('mean_bubble'))} | "
                f"{r.get('workers_final', 'n/a')} | {_f(r.get('worker_s'), ',.0f')} | {_f(r.get('speedup_per_worker'))} | "
                f"{r.get('migrations', 0)} |"
            )
        lines.append("")
        by = {(r["case"], r["policy"]): r for r in sim}
        cases = list(dict.fromkeys(r["case"] for r in sim))
        if any(r.get("vs_dense") is not None for r in sim):
            lines += [
                "### Technique alone and with dynmo at paper scale, against the dense model and the paper\n",
                "Tokens/s over the dense model's (its trace scaled and replayed alike, static uniform): the technique "
                "on static uniform, on the best static layout, and with dynmo (`optimal`, from uniform).\n",
                "| case | technique alone (uniform) | best static | technique + dynmo | dynmo from profile-once "
                "| paper | paper compares against |",
                "|---|---:|---:|---:|---:|---:|---|",
            ]
            for c in cases:
                u, o = by.get((c, "uniform"), {}), by.get((c, "optimal"), {})
                w = by.get((c, "optimal from profile-once"), {})
                if u.get("vs_dense") is None:
                    continue
                best = max((by[(c, p)].get("vs_dense") or 0.0 for p in STATIC_VARIANTS if (c, p) in by), default=None)
                paper = PAPER.get(c.split("-")[0])
                lines.append(f"| {c} | {_f(u.get('vs_dense'))} | {_f(best)} | {_f(o.get('vs_dense'))} | "
                             f"{_f(w.get('vs_dense'))} | "
                             f"{f'{paper[0]:.2f}' if paper else 'n/a'} | {paper[1] if paper else 'n/a'} |")
            lines.append("")
    if experts:
        lines += experts_section(experts)
    if units is not None:
        lines += units_section(units)
    if missing:
        lines += ["## Missing\n"] + [f"- {m}" for m in missing] + [""]
    return "\n".join(lines)
