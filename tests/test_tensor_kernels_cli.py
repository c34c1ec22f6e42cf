"""`dynmo tensor mttkrp`, `reorder`, `cp --format`, `advise`: outputs and bad input (one line, exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("numba")

from dynmo.cli import main as dynmo_main  # noqa: E402
from dynmo.tensor.coo import from_coo  # noqa: E402
from dynmo.tensor.tns import read_tns, write_tns  # noqa: E402


@pytest.fixture
def tns(tmp_path):
    rng = np.random.default_rng(0)
    sizes = (40, 30, 50)
    key = np.unique(rng.integers(0, np.prod(sizes), 3000))
    t = from_coo(np.vstack(np.unravel_index(key, sizes)), rng.random(key.size), sizes)
    write_tns(t, tmp_path / "t.tns")
    return tmp_path / "t.tns"


def test_mttkrp_reports_every_mode_as_json(tns, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert dynmo_main(["tensor", "mttkrp", str(tns), "--rank", "8", "--format", "hicoo", "--reorder", "degree",
                       "--threads", "1", "--repeats", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "hicoo" and doc["reorder"] == "degree"
    assert [m["mode"] for m in doc["modes"]] == [0, 1, 2] and all(m["seconds"] > 0 for m in doc["modes"])
    assert doc["convert_seconds"] >= 0 and doc["bytes_per_nnz"] > 8
    assert "mode 2:" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--format", "dense"], "--format dense: give coo, csf, hicoo or auto"),
    (["--mode", "3"], "--mode 3: the tensor has modes 0 to 2"),
    (["--mode", "x"], "--mode x: give a mode number"),
    (["--reorder", "sideways"], "--reorder sideways: give none, auto"),
    (["--rank", "0"], "--rank 0: give 1 to 1000"),
    (["--format", "csf", "--memory-gb", "1e-6"], "--format csf may take up to"),
])
def test_mttkrp_bad_input_is_one_line_and_exit_2(tns, capsys, extra, message):
    assert dynmo_main(["tensor", "mttkrp", str(tns), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_reorder_writes_the_tensor_and_its_permutations(tns, tmp_path, capsys):
    out = tmp_path / "r.tns"
    assert dynmo_main(["tensor", "reorder", str(tns), "--method", "bfs-mcs", "--out", str(out)]) == 0
    a, b = read_tns(tns), read_tns(out)
    perms = [np.loadtxt(tmp_path / f"r.mode{m}.perm", dtype=np.int64) - 1 for m in range(3)]
    back = np.vstack([p[c] for p, c in zip(perms, b.coords)])  # new index -> old index
    order_a = np.lexsort(a.coords[::-1])
    order_b = np.lexsort(back[::-1])
    assert np.array_equal(a.coords[:, order_a], back[:, order_b])
    assert np.array_equal(a.values[order_a], b.values[order_b])
    assert dynmo_main(["tensor", "reorder", str(tns), "--method", "bfs-mcs", "--out", str(out)]) == 2
    assert dynmo_main(["tensor", "reorder", str(tns), "--method", "zigzag", "--out", str(tmp_path / "z.tns")]) == 2


def test_cp_on_every_format_gives_numpy_s_fit(tns, tmp_path, capsys):
    fits = {}
    for fmt in ("numpy", "coo", "csf", "hicoo"):
        out = tmp_path / f"{fmt}.json"
        assert dynmo_main(["tensor", "cp", str(tns), "--rank", "3", "--iters", "3", "--format", fmt,
                           "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        fits[fmt] = doc["fits"]
        assert len(doc["mttkrp_seconds_per_mode"]) == 3
    for fmt in ("coo", "csf", "hicoo"):
        np.testing.assert_allclose(fits[fmt], fits["numpy"], rtol=1e-9)
    assert "MTTKRP per mode: 0:" in capsys.readouterr().out


def test_advise_names_a_candidate_in_mttkrp_s_values(tns, tmp_path, capsys):
    out = tmp_path / "a.json"
    assert dynmo_main(["tensor", "advise", str(tns), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["pick"]["format"] in ("coo", "csf", "hicoo")
    assert doc["pick"]["reorder"] in ("none", "lexi", "bfs-mcs", "degree")
    assert len(doc["candidates"]) == 12 and all(c["predicted_seconds"] > 0 for c in doc["candidates"])
    feats = tmp_path / "f.json"
    assert dynmo_main(["tensor", "features", str(tns), "--json", str(feats), "--quiet"]) == 0
    assert dynmo_main(["tensor", "advise", str(feats), "--json", str(tmp_path / "b.json")]) == 0
    # the same inputs from the features' JSON but the numbering, which it does not hold: that one has no say
    from dynmo.tensor.advise import FEATURES, load_model, predict, tensor_inputs, vector
    from dynmo.tensor.tns import read_tns

    model, x = load_model(), vector(tensor_inputs(read_tns(tns)))
    x[FEATURES.index("heavy_first")] = model["mean"][FEATURES.index("heavy_first")]
    fed = json.loads((tmp_path / "b.json").read_text())
    assert fed["candidates"] == sorted(predict(model, x), key=lambda c: c["predicted_ratio"])
    assert dynmo_main(["tensor", "advise", str(tns), "--model", str(tmp_path / "none.json")]) == 2
    assert dynmo_main(["tensor", "mttkrp", str(tns), "--format", "auto", "--reorder", "auto", "--repeats", "1"]) == 0


def test_fit_advisor_refuses_again_with_labelled_only(tns, tmp_path, capsys):
    args = ["tensor", "fit-advisor", str(tns), "--out", str(tmp_path / "m.json")]
    assert dynmo_main([*args, "--again", "--labelled-only"]) == 2
    assert "--again" in capsys.readouterr().err
    assert dynmo_main([*args, "--budget", "-1"]) == 2
