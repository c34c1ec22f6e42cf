"""`dynmo tensor dataset`: every index row's measured features are those a fresh `features` run
finds on its file; a run killed half way and started again finishes with every tensor once;
a grid the sizes cannot hold, or a folder of something else, is one line and exit 2 before
anything is written."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("duckdb")

from dynmo.cli import main as dynmo_main  # noqa: E402
from dynmo.tensor import features, read_tns  # noqa: E402
from dynmo.tensor.dataset import measured  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

GRID = ROOT / "configs" / "tensor-grid.toml"


def rows(folder: Path) -> list[dict]:
    with (folder / "index.csv").open(newline="") as fh:
        return list(csv.DictReader(fh))


def assert_complete(folder: Path, n: int) -> None:
    index = rows(folder)
    assert [r["file"] for r in index] == [f"t{k:05d}.tns" for k in range(n)]  # each once, in order
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [r["file"] for r in index] + ["grid.toml", "index.csv", "index.parquet"])  # nothing half-written
    import duckdb

    assert duckdb.sql(f"SELECT count(*) FROM '{folder / 'index.parquet'}'").fetchall()[0][0] == n
    for row in index:
        fresh = measured(features(read_tns(folder / row["file"], values=False)).to_dict())
        for key, value in fresh.items():
            assert row[key] == str(value), (row["file"], key)


def test_the_shipped_grid_indexes_what_features_measures(tmp_path, capsys):
    out = tmp_path / "ds"
    assert dynmo_main(["tensor", "dataset", "--grid", str(GRID), "--out", str(out), "--quiet"]) == 0
    assert_complete(out, 24)
    index = rows(out)
    assert all(int(r["measured_nnz"]) < 1_000_000 for r in index)
    # what was asked is what the generator met: the density exactly, the cvs within its tolerance
    for r in index:
        assert float(r["measured_density"]) == pytest.approx(float(r["requested_density"]), rel=1e-3)
        last = len(r["requested_sizes"].split("x")) - 1
        got = float(r[f"measured_nnz_per_fiber_{last}_cv_onlynz"])
        assert got == pytest.approx(float(r["requested_cv_nnz_per_fiber"]), rel=0.02)
    # run again: nothing to do, nothing changed
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".tns"}
    assert dynmo_main(["tensor", "dataset", "--grid", str(GRID), "--out", str(out), "--quiet"]) == 0
    assert "0 made now, 24 there already" in capsys.readouterr().out
    assert before == {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".tns"}


def test_killed_half_way_and_started_again_it_is_complete_with_no_duplicate(tmp_path):
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "dynmo.cli", "tensor", "dataset", "--grid", str(GRID), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 120
        while not ((out / "index.csv").exists() and len(rows(out)) >= 5):
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    # stopped at 5 or more of 24 (on a machine so busy that this poller slept through the rest,
    # the run may have finished first: the restart must then make nothing, checked the same way)
    assert len(rows(out)) >= 5
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert_complete(out, 24)


def test_siblings_of_real_tensors_join_the_grid(tmp_path):
    real = tmp_path / "real.tns"
    assert dynmo_main(["tensor", "ngram", "--order", "3", "--out", str(real)]) == 0
    grid = tmp_path / "g.toml"
    grid.write_text("seed = 5\n[like]\nscale = [0.5, 1.0]\n")
    out = tmp_path / "ds"
    assert dynmo_main(["tensor", "dataset", "--grid", str(grid), "--out", str(out), "--like", str(real),
                       "--quiet"]) == 0
    assert_complete(out, 2)
    index = rows(out)
    assert [r["requested_scale"] for r in index] == ["0.5", "1.0"]
    assert int(index[0]["measured_nnz"]) < int(index[1]["measured_nnz"])


OK = "[grid]\nsizes = [[20, 20, 20]]\nfiber_density = [0.25]\n"  # with a density of 0.05 or 0.1: feasible


@pytest.mark.parametrize("grid,message", [
    (OK + "density = [0.05, 2.0]\n", "grid point 1 (sizes 20x20x20, density 2.0"),
    (OK + "density = [0.05]\ncv_nnz_per_fiber = [0.5, 9.0]\n", "grid point 1 (sizes 20x20x20, density 0.05, "),
    ("[grid]\nsizes = [[10, 10]]\ndensity = [0.1]\n", "each entry is a list of 3 or more sizes"),
    ("[grid]\nsizes = [[10, 10, 10]]\n", "[grid] needs sizes and density"),
    ("[grid]\nsizes = [[10, 10, 10]]\ndensity = [0.1]\nspeed = [1]\n", "unknown [grid] key(s) speed"),
    ("seed = -1\n", "seed -1: give a whole number >= 0"),
    ("values = 'big'\n", "values 'big': choose one of"),
    ("x = [\n", "not TOML"),
    ("", "nothing to make"),
])
def test_a_bad_grid_is_one_line_and_writes_nothing(tmp_path, grid, message, capsys):
    (tmp_path / "g.toml").write_text(grid)
    out = tmp_path / "ds"
    assert dynmo_main(["tensor", "dataset", "--grid", str(tmp_path / "g.toml"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dynmo tensor: error: ") and message in err[0], err
    assert not out.exists()


def test_a_folder_of_something_else_is_left_alone(tmp_path, capsys):
    (tmp_path / "g1.toml").write_text(OK + "density = [0.05]\n")
    (tmp_path / "g2.toml").write_text(OK + "density = [0.1]\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert dynmo_main(["tensor", "dataset", "--grid", str(tmp_path / "g1.toml"), "--out", str(mine)]) == 2
    assert "a folder with other files and no dataset" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    out = tmp_path / "ds"
    assert dynmo_main(["tensor", "dataset", "--grid", str(tmp_path / "g1.toml"), "--out", str(out), "--quiet"]) == 0
    assert dynmo_main(["tensor", "dataset", "--grid", str(tmp_path / "g2.toml"), "--out", str(out)]) == 2
    assert "holds the dataset of another grid" in capsys.readouterr().err
    assert rows(out)[0]["requested_density"] == "0.05"
    assert dynmo_main(["tensor", "dataset", "--grid", str(tmp_path / "g2.toml"), "--out", str(out), "--quiet",
                       "--overwrite"]) == 0
    assert rows(out)[0]["requested_density"] == "0.1"
    assert_complete(out, 1)
