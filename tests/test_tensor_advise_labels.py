"""The advisor's labels and model file: each candidate's time is its least over interleaved rounds,
labels of another version are refused, a feature the inputs lack has no say, and the model is
plain JSON (nothing is timed for real here: the clock is made up)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynmo.tensor.advise import FEATURES, MODEL, advise, json_inputs, load_model, predict, tensor_inputs, vector
from dynmo.tensor.advise_fit import LABEL_FIELDS, MAX_ROUNDS, _read_labels, time_candidates


class FakeClock:
    """A clock that a run moves on by the candidate's cost, plus a load on some calls."""

    def __init__(self, cost, load):
        self.now, self.cost, self.load, self.calls = 0.0, cost, load, []

    def __call__(self):
        return self.now

    def run(self, lay, mode):
        self.calls.append((lay, mode))
        self.now += self.cost[lay][mode] + self.load(len(self.calls))


def test_label_is_each_mode_s_least_over_rounds_summed():
    cost = {"a": [1.0, 2.0], "b": [3.0, 0.5], "c": [1.0, 1.0]}
    clock = FakeClock(cost, lambda n: 7.0 if n % 3 == 0 else 0.0)  # every third run slowed
    got, rounds = time_candidates({c: c for c in cost}, [4, 5], rank=2, repeats=4, run=clock.run, clock=clock)
    # the load never counts: some round ran each mode unslowed
    assert rounds == dict.fromkeys("abc", 4) and got == {"a": 3.0, "b": 3.5, "c": 2.0}


def test_rounds_interleave_the_candidates_each_starting_elsewhere():
    cost = {c: [1.0] for c in "abc"}
    clock = FakeClock(cost, lambda n: 0.0)
    time_candidates({c: c for c in cost}, [4], rank=2, repeats=3, run=clock.run, clock=clock)
    order = "".join(lay for lay, _ in clock.calls)
    assert order == "abc" + "abc" + "bca" + "cab"  # one untimed pass, then rounds rotated


def test_a_burst_of_load_during_one_candidate_does_not_decide():
    cost = {"fast": [1.0], "slow": [1.2]}
    clock = FakeClock(cost, lambda n: 5.0 if n in (3, 6) else 0.0)  # the burst hits "fast" in two rounds
    got, _ = time_candidates({c: c for c in cost}, [4], rank=2, repeats=3, run=clock.run, clock=clock)
    assert min(got, key=got.get) == "fast"


def test_more_rounds_go_to_the_close_calls_until_the_budget_is_spent():
    cost = {"a": [1.0], "b": [1.2], "far": [9.0]}
    clock = FakeClock(cost, lambda n: 0.0)
    _, rounds = time_candidates({c: c for c in cost}, [4], rank=2, repeats=2, budget=39.0, run=clock.run, clock=clock)
    # 2 rounds of all (22.4 s), then a and b (2.2 s a round) until 39 s are spent
    assert rounds == {"a": 10, "b": 10, "far": 2}
    clock = FakeClock(cost, lambda n: 0.0)
    _, rounds = time_candidates({c: c for c in cost}, [4], rank=2, repeats=2, budget=1e9, run=clock.run, clock=clock)
    assert rounds["a"] == MAX_ROUNDS


def test_labels_of_another_version_are_refused_and_other_settings_ignored(tmp_path):
    old = tmp_path / "labels.csv"
    old.write_text("file,format,reorder,seconds\nt.tns,csf,none,0.1\n")
    with pytest.raises(ValueError, match="another version"):
        _read_labels(old, 16, 2)
    new = tmp_path / "labels2.csv"
    new.write_text(",".join(LABEL_FIELDS) + "\nt.tns,csf,none,16,2,5,0.1\nt.tns,csf,lexi,8,2,5,0.2\n")
    assert _read_labels(new, 16, 2) == {("t.tns", "csf", "none"): 0.1}
    with open(new, "a") as fh:  # labelled again (--again): the least of both runs counts
        fh.write("t.tns,csf,none,16,2,40,0.08\nt.tns,csf,none,16,2,40,0.3\n")
    assert _read_labels(new, 16, 2) == {("t.tns", "csf", "none"): 0.08}


def test_the_model_is_plain_json_and_loads():
    doc = json.loads(MODEL.read_text())  # nothing but JSON: loading it runs no code
    assert doc == load_model() and doc["features"] == list(FEATURES)
    assert len(doc["candidates"]) == 12


def _tensor():
    """Skewed slices (Zipf-like counts) in every mode, numbered at random."""
    from dynmo.tensor.coo import from_coo

    rng = np.random.default_rng(3)
    sizes = (60, 70, 80)
    coords = np.array([rng.permutation(s)[np.minimum(rng.zipf(1.6, 3000), s) - 1] for s in sizes])
    coords = np.unique(coords, axis=1)
    return from_coo(coords, np.ones(coords.shape[1]), sizes)


def _counts(inp):
    """The inputs from the slice counts alone (to 12 digits: a sum's last bit may differ)."""
    return [{k: round(v, 12) for k, v in m.items() if k != "heavy_first"} for m in inp["modes"]]


def test_a_feature_the_inputs_lack_counts_as_the_training_mean():
    t = _tensor()
    full = tensor_inputs(t)
    lacking = {**full, "modes": [{k: v for k, v in m.items() if k != "heavy_first"} for m in full["modes"]]}
    x = vector(lacking)
    k = FEATURES.index("heavy_first")
    assert np.isnan(x[k]) and np.isfinite(np.delete(x, k)).all()
    model = load_model()
    filled = vector(full)
    filled[k] = model["mean"][k]
    assert predict(model, x) == predict(model, filled)
    assert advise(lacking, model)["pick"]["format"] in ("coo", "csf", "hicoo")


def test_heavy_first_sees_the_numbering_not_the_counts():
    from dynmo.tensor.reorder import reorder

    t = _tensor()
    by_degree = tensor_inputs(reorder(t, "degree")[0])
    at_random = tensor_inputs(reorder(t, "random", seed=1)[0])
    assert all(m["heavy_first"] > 0.99 for m in by_degree["modes"])
    assert all(abs(m["heavy_first"]) < 0.3 for m in at_random["modes"])
    assert _counts(by_degree) == _counts(at_random)


def test_a_features_json_feeds_every_input_but_the_numbering(tmp_path):
    from dynmo.tensor.features import features

    t = _tensor()
    inp = json_inputs(json.loads(json.dumps(features(t).to_dict())))
    full = tensor_inputs(t)
    assert _counts(full) == _counts(inp) and all("heavy_first" not in m for m in inp["modes"])
