"""The expert-placement replay's table (`dynmo simulate --ep`, benchmarks/replay_experts.py). Pure."""

from __future__ import annotations

from dynmo.sim.replay.experts import ExpertReplay

HEADER = ("| trace | E | slots + copies | static layout | static s | dynmo speedup | dynmo capture | "
          "dynmo re-placements | dynmo layer migrations | oracle speedup | dynmo over its start, static "
          "| busiest / mean: static, dynmo, oracle |")
RULE = "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"


def _f(x, fmt: str = ".3f") -> str:
    return "" if x is None else format(x, fmt)


def table_lines(rows: list[tuple[str, int, ExpertReplay]]) -> list[str]:
    """One row per (trace name, E, replay): static's total seconds, dynmo's and the oracle's
    speedups over static, dynmo's capture, moves, its speedup over its start left static (with
    the layout decided; else n/a), and the busiest EP rank's load over the mean rank's."""
    out = [HEADER, RULE]
    for name, ep, rep in rows:
        r, sh = rep.results, rep.shape
        d = r["dynmo"]
        cells = [_f(d.speedup), _f(d.capture, ".2f"), str(d.migrations), str(d.layer_migrations),
                 _f(r["oracle"].speedup), _f(r["start"].total_s / d.total_s) if "start" in r else "n/a"]
        busy = ", ".join(f"{r[n].as_dict()['mean_busiest_over_mean']:.3f}" for n in ("static", "dynmo", "oracle"))
        slots = f"{sh['experts'] // ep} + {sh['extra_slots']}, {sh['copies']}"
        out.append(f"| {name} | {ep} | {slots} | {rep.layout_name} | {r['static'].total_s:.1f} | "
                   + " | ".join(cells) + f" | {busy} |")
    return out


def split_line(name: str, rep: ExpertReplay) -> str:
    """How the trace's MoE layer cost was split into its non-expert and expert parts."""
    s = rep.split
    fit = s["fit"]
    if fit["usable"]:
        how = (f"fit cost/microbatch = {fit['a'] * 1e3:.2f} ms + {fit['b'] * 1e6:.2f} us x padded rows "
               f"(R^2 {fit['r2']:.2f}, {fit['points']} points)")
        share = f"fit {s['expert_share_fit']:.2f}, "
    else:
        how, share = "the fit is unusable here", ""
    return (f"split of {name}: {s['used']}; {how}; expert share of the median MoE layer "
            f"({s['median_padded_rows']:.0f} padded rows): {share}FLOPs {s['expert_share_flops']:.2f}")
