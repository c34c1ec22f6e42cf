"""`dynmo tensor` refuses, before any work, what the machine's memory or disk cannot hold.

The machine's figures are injected (`dynmo.machine`'s environment variables)."""

import contextlib
import io

import numpy as np
import pytest

from dynmo.tensor import budget
from dynmo.tensor.cli import main
from dynmo.tensor.generate import Request, _cv, cv_range, plan
from tests.conftest import ROOT

SMALL = ["--sizes", "40,30,20", "--density", "0.05", "--fiber-density", "0.5"]


@pytest.fixture
def machine(monkeypatch):
    def set_(ram="16G", disk="1T"):
        monkeypatch.setenv("DYNMO_MEMORY_AVAILABLE", ram)
        monkeypatch.setenv("DYNMO_DISK_FREE", disk)
    set_()
    return set_


def run(*argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.mark.parametrize("extra,words", [
    (["--sizes", "1000000000,1000000000,1000000000"], "of memory but 16.00 GB is available; use --memory-gb"),
    (["--sizes", "100000,100000,100000"], "of memory but 16.00 GB is available; use --memory-gb"),
    (["--sizes", "100000,100000,100000", "--memory-gb", "8"], "TB but"),
])
def test_generate_refuses_what_cannot_fit(tmp_path, machine, extra, words):
    machine(disk="70G")
    code, err = run("generate", *extra, "--density", "1e-3", "--out", str(tmp_path / "X.tns"))
    assert code == 2 and err.count("\n") == 1 and words in err
    assert list(tmp_path.iterdir()) == []


def test_the_text_estimate_is_the_bytes_written(tmp_path, machine):
    out = tmp_path / "t.tns"
    for values in ("uniform", "ones"):
        assert run("generate", *SMALL, "--values", values, "--out", str(out), "--overwrite")[0] == 0
        r = Request((40, 30, 20), 0.05, fiber_density=0.5, values=values)
        need = budget.generate_need(plan(r), r.sizes, values, None, str(out))
        assert need.disk == out.stat().st_size
    machine(disk=str(out.stat().st_size - 1))
    code, err = run("generate", *SMALL, "--out", str(tmp_path / "u.tns"))
    assert code == 2 and "free; use smaller --sizes" in err and not (tmp_path / "u.tns").exists()


def test_features_and_convert_check_memory_and_the_temporary_files(tmp_path, machine):
    src = tmp_path / "t.tns"
    assert run("generate", *SMALL, "--out", str(src))[0] == 0
    assert run("features", str(src), "--quiet")[0] == 0
    machine(ram="1K")
    code, err = run("features", str(src), "--quiet")
    assert code == 2 and "use --memory-gb G" in err
    machine(disk="1K")
    code, err = run("features", str(src), "--quiet", "--memory-gb", "0.5", "--tmp", str(tmp_path))
    assert code == 2 and "--tmp DIR on a larger disk" in err
    code, err = run("convert", str(src), str(tmp_path / "t.parquet"))
    assert code == 2 and "writes about" in err and not (tmp_path / "t.parquet").exists()


def test_dataset_checks_all_its_tensors_before_writing(tmp_path, machine):
    machine(disk="1K")
    out = tmp_path / "ds"
    code, err = run("dataset", "--grid", str(ROOT / "configs" / "tensor-grid.toml"), "--out", str(out))
    assert code == 2 and "this dataset writes about" in err and not out.exists()


@pytest.mark.parametrize("n,total,hi", [(10, 100, 20), (7, 30, 5), (1000, 10**6, 1000), (5, 5, 1), (3, 9, 3)])
def test_cv_range_needs_no_array_of_the_counts(n, total, hi):
    k = (total - n) // (hi - 1) if hi > 1 else 0
    rest = total - k * hi - (n - k - 1) if k < n else 0
    vals = np.array([hi] * k + ([rest] if k < n else []) + [1] * max(0, n - k - 1), dtype=np.float64)
    assert cv_range(n, total, hi)[1] == pytest.approx(_cv(vals), rel=1e-12)
