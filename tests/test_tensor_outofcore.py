"""`dynmo tensor features --memory-gb`: the out-of-core path gives every feature the in-memory
path gives, on any tensor, in blocks of any size; bad input is one line and exit 2, the same
line as in memory; the temporary folder is gone afterwards, whatever happened."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("duckdb")

from dynmo.cli import main as dynmo_main  # noqa: E402
from dynmo.tensor import features, from_coo, read_tns  # noqa: E402
from dynmo.tensor import outofcore  # noqa: E402
from dynmo.tensor.tns import write_tns  # noqa: E402
from tests.test_tensor_features import BAD, write  # noqa: E402


def both(path, tmp, **kw) -> tuple[dict, dict]:
    """The features of `path` in memory and out of core (with 1 GB: the path, not the budget, is
    under test here)."""
    mem = features(read_tns(path, values=False, sizes=kw.get("sizes"), header=kw.get("header"))).to_dict()
    ooc = outofcore.features_within(path, 1.0, tmp, **kw).to_dict()
    return mem, ooc


def random_tensor(rng, order: int, nnz: int, skew: float):
    """Distinct coordinates, indices drawn with a power-law skew (ragged slices and fibers)."""
    sizes = [int(rng.integers(2, 40)) for _ in range(order)]
    cap = int(np.prod(sizes))
    nnz = min(nnz, cap)
    keys = set()
    while len(keys) < nnz:
        keys.add(tuple(int(min(s - 1, rng.pareto(skew) * s / 4)) if skew else int(rng.integers(s)) for s in sizes))
    coords = np.array(sorted(keys), dtype=np.int64).T
    return from_coo(coords, rng.random(coords.shape[1]) + 0.1, sizes=tuple(sizes))


@settings(max_examples=25, deadline=None)
@given(order=st.integers(2, 5), nnz=st.integers(1, 400), skew=st.sampled_from([0.0, 1.0, 3.0]),
       seed=st.integers(0, 2**16), block=st.sampled_from([64, 1000, 1 << 25]), header=st.booleans())
def test_every_feature_equals_the_in_memory_path(tmp_path_factory, order, nnz, skew, seed, block, header):
    tmp = tmp_path_factory.mktemp("ooc")
    t = random_tensor(np.random.default_rng(seed), order, nnz, skew)
    path = tmp / "t.tns"
    write_tns(t, path, header=header)
    old = outofcore.BLOCK_BYTES
    outofcore.BLOCK_BYTES = block  # blocks of a line or two up to the whole file
    try:
        mem, ooc = both(path, tmp)
    finally:
        outofcore.BLOCK_BYTES = old
    assert ooc == mem
    assert [p.name for p in tmp.iterdir()] == ["t.tns"]  # the temporary folder is gone


def test_gzip_comments_given_sizes_and_a_real_tensor(tmp_path):
    text = "# words\n3\n4 5 6\n1 1 1 1.0\n# a note\n2 5 6 2.5\n4 5 1 1.0\n4 1 6 1.0\n"
    write(tmp_path / "c.tns", text)
    with gzip.open(tmp_path / "c.tns.gz", "wt") as f:
        f.write(text)
    for name in ("c.tns", "c.tns.gz"):
        mem, ooc = both(tmp_path / name, tmp_path)
        assert ooc == mem
    mem, ooc = both(tmp_path / "c.tns", tmp_path, sizes=(9, 9, 9))
    assert ooc == mem and ooc["sizes"] == [9, 9, 9]
    # word 3-grams of the bundled plays: a real, skewed tensor
    assert dynmo_main(["tensor", "ngram", "--order", "3", "--out", str(tmp_path / "g.tns")]) == 0
    mem, ooc = both(tmp_path / "g.tns", tmp_path)
    assert ooc == mem and ooc["nnz"] > 100_000


@pytest.mark.parametrize("text,message", BAD)
def test_bad_files_give_the_in_memory_paths_line(tmp_path, text, message, capsys):
    write(tmp_path / "a.tns", text)
    out = tmp_path / "f.json"
    assert dynmo_main(["tensor", "features", str(tmp_path / "a.tns"), "--memory-gb", "0.5", "--json", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynmo tensor: error: "), lines
    assert message in lines[0]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tns"]  # nothing left behind


def test_a_bad_line_in_a_later_block_is_named(tmp_path, monkeypatch, capsys):
    lines = [f"{i % 7 + 1} {i // 7 + 1} 1.0" for i in range(300)]
    lines[250] = "3 x 1.0"
    write(tmp_path / "a.tns", "\n".join(lines) + "\n")
    monkeypatch.setattr(outofcore, "BLOCK_BYTES", 256)
    assert dynmo_main(["tensor", "features", str(tmp_path / "a.tns"), "--memory-gb", "0.5"]) == 2
    assert "a.tns:251: index 'x' in column 2 is not a whole number" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--memory-gb", "0"], "--memory-gb 0.0: give a positive number of GB"),
    (["--memory-gb", "1", "--plot", "p.png"], "--plot draws every count"),
    (["--tmp", "."], "--tmp is for --memory-gb's temporary files"),
    (["--memory-gb", "1", "--tmp", "no/such/folder"], "not a folder this process can write to"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path, args, message, capsys, monkeypatch):
    write(tmp_path / "a.tns", "1 1 1 1.0\n2 2 2 1.0\n")
    monkeypatch.chdir(tmp_path)
    assert dynmo_main(["tensor", "features", "a.tns", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_the_cli_writes_what_the_in_memory_path_writes(tmp_path):
    t = random_tensor(np.random.default_rng(3), 4, 300, 1.0)
    write_tns(t, tmp_path / "t.tns")
    for flag, out in (([], "mem.json"), (["--memory-gb", "0.2"], "ooc.json")):
        assert dynmo_main(["tensor", "features", str(tmp_path / "t.tns"), "--json", str(tmp_path / out),
                           "--quiet", *flag]) == 0
    assert json.loads((tmp_path / "ooc.json").read_text()) == json.loads((tmp_path / "mem.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.json", "ooc.json", "t.tns"]


# ---- Parquet: `dynmo tensor convert`, read in memory and out of core -------------------------


@settings(max_examples=12, deadline=None)
@given(order=st.integers(2, 4), nnz=st.integers(1, 300), seed=st.integers(0, 2**16), header=st.booleans())
def test_a_converted_tensor_has_the_same_features_and_values(tmp_path_factory, order, nnz, seed, header):
    from dynmo.tensor.parquet import read_parquet

    tmp = tmp_path_factory.mktemp("pq")
    t = random_tensor(np.random.default_rng(seed), order, nnz, 1.0)
    if header:  # sizes beyond the largest indices: only the header (then the metadata) knows them
        t = from_coo(t.coords, t.values, sizes=tuple(s + 3 for s in t.sizes))
    write_tns(t, tmp / "t.tns", header=header)
    assert dynmo_main(["tensor", "convert", str(tmp / "t.tns"), str(tmp / "t.parquet")]) == 0
    text, binary = read_tns(tmp / "t.tns"), read_parquet(tmp / "t.parquet")
    assert binary.sizes == text.sizes and np.array_equal(binary.coords, text.coords)
    assert np.array_equal(binary.values, text.values)
    mem = features(text).to_dict()
    for got in (features(binary).to_dict(), outofcore.features_within(tmp / "t.parquet", 0.5, tmp).to_dict()):
        got["name"] = mem["name"]
        assert got == mem
    assert sorted(p.name for p in tmp.iterdir()) == ["t.parquet", "t.tns"]


@pytest.mark.parametrize("text,message", BAD)
def test_convert_refuses_what_features_refuses(tmp_path, text, message, capsys):
    write(tmp_path / "a.tns", text)
    code = dynmo_main(["tensor", "convert", str(tmp_path / "a.tns"), str(tmp_path / "a.parquet")])
    lines = capsys.readouterr().err.strip().splitlines()
    if "appears twice" in message:  # converting copies; the features find the repeat, by row
        assert code == 0
        assert dynmo_main(["tensor", "features", str(tmp_path / "a.parquet")]) == 2
        err = capsys.readouterr().err
        assert "appears twice" in err and ": row " in err
        return
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tns"]  # no output, no temporary file


def test_a_file_that_is_not_a_dynmo_parquet_is_one_line(tmp_path, capsys):
    write(tmp_path / "x.parquet", "not parquet\n")
    assert dynmo_main(["tensor", "features", str(tmp_path / "x.parquet")]) == 2
    assert "not a Parquet file" in capsys.readouterr().err
    import duckdb

    duckdb.sql(f"COPY (SELECT 1 AS a, 2 AS b) TO '{tmp_path / 'y.parquet'}' (FORMAT parquet)")
    assert dynmo_main(["tensor", "features", str(tmp_path / "y.parquet"), "--memory-gb", "0.5"]) == 2
    assert "expected index columns i0, i1" in capsys.readouterr().err


def test_no_room_for_temporary_files_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import subprocess

    monkeypatch.setenv("DYNMO_DISK_FREE", "1T")  # past the pre-flight check: the spill itself fails

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        from dynmo.tensor.generate import Request, generate

        write_tns(generate(Request((100, 100, 100), 0.1, fiber_density=0.5)), tmp_path / "t.tns")  # 100k nonzeros
        # 64 KB: less than a DuckDB database takes before its first block of data
        assert dynmo_main(["tensor", "features", str(tmp_path / "t.tns"), "--memory-gb", "0.5", "--tmp", str(tiny),
                           "--json", str(tmp_path / "f.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "No space left on device" in err[0] and err[0].startswith("dynmo tensor: error: "), err
        assert list(tiny.iterdir()) == [] and not (tmp_path / "f.json").exists()
    finally:
        subprocess.run(["umount", "-l", str(tiny)])
