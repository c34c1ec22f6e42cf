"""`dynmo tensor features --dask`: on a Dask cluster (a LocalCluster this test starts), every
feature equals the in-memory path's, whether the input is one file cut into many pieces or a
folder of shards; bad input is one line and exit 2."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

pytest.importorskip("distributed")

from dynmo.cli import main as dynmo_main  # noqa: E402
from dynmo.tensor import features, read_tns  # noqa: E402
from dynmo.tensor import cluster  # noqa: E402
from dynmo.tensor.tns import write_tns  # noqa: E402
from tests.test_tensor_features import write  # noqa: E402
from tests.test_tensor_outofcore import random_tensor  # noqa: E402


@pytest.fixture(scope="module")
def scheduler():
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        yield c.scheduler_address


def test_every_feature_equals_the_in_memory_path(tmp_path, scheduler, monkeypatch):
    for seed, (order, nnz, skew, piece) in enumerate([(2, 300, 1.0, 97), (3, 400, 3.0, 512), (4, 350, 0.0, 64),
                                                      (5, 200, 1.0, 1 << 26), (3, 1, 0.0, 64)]):
        t = random_tensor(np.random.default_rng(seed), order, nnz, skew)
        path = tmp_path / f"t{seed}.tns"
        write_tns(t, path, header=seed % 2 == 1)
        monkeypatch.setattr(cluster, "PIECE_BYTES", piece)  # pieces of a line or two up to the whole file
        got = cluster.features_on_dask(path, scheduler, parts=3).to_dict()
        assert got == features(read_tns(path, values=False)).to_dict(), (order, nnz, piece)


def test_a_folder_of_shards_is_one_tensor(tmp_path, scheduler):
    t = random_tensor(np.random.default_rng(7), 4, 500, 1.0)
    write_tns(t, tmp_path / "whole.tns")
    lines = (tmp_path / "whole.tns").read_text().splitlines(keepends=True)
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(4):
        (shards / f"part-{k}.tns").write_text("".join(lines[k::4]))
    got = cluster.features_on_dask(shards, scheduler).to_dict()
    want = features(read_tns(tmp_path / "whole.tns", values=False)).to_dict()
    got["name"] = want["name"]
    assert got == want


def test_the_cli_with_a_local_cluster(tmp_path):
    t = random_tensor(np.random.default_rng(3), 3, 300, 1.0)
    write_tns(t, tmp_path / "t.tns")
    for flag, out in (([], "mem.json"), (["--dask", "local:2"], "dask.json")):
        assert dynmo_main(["tensor", "features", str(tmp_path / "t.tns"), "--json", str(tmp_path / out), "--quiet",
                           *flag]) == 0
    assert json.loads((tmp_path / "dask.json").read_text()) == json.loads((tmp_path / "mem.json").read_text())


def test_bad_input_is_one_line(tmp_path, scheduler, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    write(shards / "a.tns", "1 1 1 1.0\n2 2 2 1.0\n")
    write(shards / "b.tns", "3 3 3 1.0\n1 1 1 2.0\n")  # repeats a's first coordinate
    assert dynmo_main(["tensor", "features", str(shards), "--dask", scheduler]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "coordinate (1, 1, 1) (1-based) appears twice" in err[0], err
    write(tmp_path / "bad.tns", "1 1 1 1.0\n2 x 1 1.0\n")
    assert dynmo_main(["tensor", "features", str(tmp_path / "bad.tns"), "--dask", scheduler]) == 2
    assert "bad.tns:2: index 'x' in column 2 is not a whole number" in capsys.readouterr().err
    for args, message in ((["--dask", "local:0"], "give local:N with N >= 1"),
                          (["--dask", "local:2", "--memory-gb", "1"], "leave out --memory-gb and --plot")):
        assert dynmo_main(["tensor", "features", str(tmp_path / "bad.tns"), *args]) == 2
        assert message in capsys.readouterr().err


# Stand-ins for round 1's task that the workers import from this module (a task travels by
# name): one that kills its worker process once, one that kills every worker it lands on.
def _map_dying_once(piece, parts, marker):
    import os
    from pathlib import Path

    if not Path(marker).exists():
        Path(marker).write_text("died")
        os._exit(1)  # the worker process, mid-task: Dask's nanny starts a new one
    return cluster.map_piece(piece, parts)


def _map_always_dying(piece, parts):
    import os

    os._exit(1)


def test_a_worker_lost_mid_run_changes_nothing(tmp_path, monkeypatch):
    """The worker running a piece dies; Dask runs the piece again on a worker it still has, and
    every feature still equals the in-memory path's."""
    from distributed import LocalCluster

    t = random_tensor(np.random.default_rng(11), 3, 400, 1.0)
    write_tns(t, tmp_path / "t.tns")
    marker = tmp_path / "died"
    monkeypatch.setattr(cluster, "map_piece", functools.partial(_map_dying_once, marker=str(marker)))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        got = cluster.features_on_dask(tmp_path / "t.tns", c.scheduler_address, parts=2).to_dict()
    assert marker.read_text() == "died"
    assert got == features(read_tns(tmp_path / "t.tns", values=False)).to_dict()


def test_a_task_that_kills_every_worker_is_one_line(tmp_path, monkeypatch, capsys):
    from distributed import LocalCluster

    t = random_tensor(np.random.default_rng(12), 3, 50, 0.0)
    write_tns(t, tmp_path / "t.tns")
    monkeypatch.setattr(cluster, "map_piece", _map_always_dying)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        assert dynmo_main(["tensor", "features", str(tmp_path / "t.tns"), "--dask", c.scheduler_address,
                           "--json", str(tmp_path / "f.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dask" in err[0] and "KilledWorker" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.tns"]  # nothing half-written
