"""benchmarks/bench_mttkrp.py with orderings: argument errors, and dynmo's best taken over formats x
orderings and named in the table (figures made up here; nothing is timed)."""

from tests.conftest import load_benchmark

bench = load_benchmark("bench_mttkrp")


def _row(name="t"):
    def v(fmt, ordering, modes):
        return {"modes": modes, "all": sum(modes), "format": fmt, "reorder": ordering, "reorder_seconds": 0.0,
                "convert": 0.1, "bytes_per_nnz": 40.0}
    dyn = {bench.variant(f, o): v(f, o, m) for f, o, m in [
        ("coo", "none", [4.0, 5.0, 6.0]), ("csf", "none", [3.0, 3.0, 3.0]),
        ("coo", "lexi", [1.0, 4.0, 6.0]), ("csf", "lexi", [2.0, 2.0, 2.5])]}
    splatt = {"bench-csf": {"modes": [2.0, 2.0, 2.0], "all": 6.0}}
    return {"name": name, "order": 3, "sizes": [5, 5, 5], "nnz": 10, "load": 1.0, "dynmo": dyn, "splatt": splatt,
            "splatt_reordered": {"lexi": {"bench-csf": {"modes": [1.5, 2.0, 2.0], "all": 5.5}}},
            "pyttb": {"modes": {0: 20.0, 1: 20.0, 2: 20.0}}}


def test_best_is_over_formats_and_orderings():
    s = bench.summarize([_row()])
    r = s["tensors"][0]
    assert r["dynmo_best_modes"] == [(1.0, "coo+lexi"), (2.0, "csf+lexi"), (2.5, "csf+lexi")]
    assert r["dynmo_best_all"] == (6.5, "csf+lexi")
    assert r["ratio_modes"] == [0.5, 1.0, 1.25]
    assert r["pyttb_speedup"] == [20.0, 10.0, 8.0]
    assert r["splatt_reordered_best"]["lexi"]["modes"][0] == (1.5, "bench-csf")
    text = bench.table(s)
    assert "| dynmo none (format) | dynmo lexi (format) | dynmo best (format+ordering) |" in text
    assert "| t | 10 | 0 | 3000.0 (csf) | 1000.0 (coo) | 1000.0 (coo+lexi) | 2000.0 (bench-csf) | 0.50 | 1500.0 (bench-csf) | 20000.0 | 20x |" in text
    assert "| t | 10 | all | 9000.0 (csf) | 6500.0 (csf) | 6500.0 (csf+lexi) |" in text


def test_without_orderings_the_table_has_a_column_per_format():
    row = _row()
    row["dynmo"] = {k: v for k, v in row["dynmo"].items() if v["reorder"] == "none"}
    del row["splatt_reordered"]
    text = bench.table(bench.summarize([row]))
    assert "| tensor | nnz | mode | dynmo coo | dynmo csf | SPLATT best (variant) |" in text
    assert "| t | 10 | 0 | 4000.0 | 3000.0 | 2000.0 (bench-csf) | 1.50 | 20000.0 | 7x |" in text


def test_orderings_are_checked(capsys):
    assert bench.main(["--reorders", "none,sideways"]) == 2
    assert "--reorders" in capsys.readouterr().err
    assert bench.main(["--reorders", "none,lexi", "--splatt-reorders", "degree"]) == 2
    assert "--splatt-reorders" in capsys.readouterr().err


def test_a_mode_splatt_reports_as_0_s_is_named_not_divided_by():
    row = _row()
    row["splatt"] = {"bench-csf": {"modes": [0.0, 2.0, 2.0], "all": 4.0}}
    s = bench.summarize([row])
    r = s["tensors"][0]
    assert r["ratio_modes"] == [None, 1.0, 1.25] and r["ratio_all"] == 6.5 / 4.0
    assert s["worst_ratio_mode"] == 1.25 and s["splatt_zero"] == ["t mode 0"]
    text = bench.table(s)
    assert "| t | 10 | 0 | 3000.0 (csf) | 1000.0 (coo) | 1000.0 (coo+lexi) | 0.0 (bench-csf) | SPLATT 0 s |" in text
    assert "SPLATT reported 0 s" in text and "t mode 0" in text
    row["splatt"] = {"bench-csf": {"modes": [0.0, 0.0, 0.0], "all": 0.0}}
    s = bench.summarize([row])
    assert s["geomean_ratio_all"] is None and s["splatt_zero"][-1] == "t all modes"
    assert "n/a" in bench.table(s)
