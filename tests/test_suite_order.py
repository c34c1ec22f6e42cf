"""The order the suite runs in (tests/conftest.py `longest_first`): every test once, the long
ones at the head of each worker's first chunk, a module's tests that share a module-scoped
fixture kept together."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import longest_first


def item(nodeid: str, scope: str = "function"):
    fixture = SimpleNamespace(scope=scope)
    return SimpleNamespace(nodeid=nodeid, _fixtureinfo=SimpleNamespace(name2fixturedefs={"f": (fixture,)}))


def chunks(items: list, workers: int) -> list[list[str]]:
    """What worksteal hands each worker at the start: the next len(left) // (workers - i)."""
    out, at = [], 0
    for w in range(workers):
        n = (len(items) - at) // (workers - w)
        out.append([i.nodeid for i in items[at:at + n]])
        at += n
    return out


def test_the_long_tests_lead_the_chunks_shared_out_longest_first():
    items = [item(f"t.py::s{i}") for i in range(20)] + [item(f"t.py::long{i}") for i in range(5)]
    seconds = {"t.py::long0": 80, "t.py::long1": 70, "t.py::long2": 60, "t.py::long3": 20, "t.py::long4": 10}
    got = longest_first(items, 2, seconds)
    assert sorted(i.nodeid for i in got) == sorted(i.nodeid for i in items)
    a, b = chunks(got, 2)
    # greedy: 80 | 70, then 60 to the lighter (70), 20 and 10 to the first (80 < 130)
    assert a[:3] == ["t.py::long0", "t.py::long3", "t.py::long4"] and b[:2] == ["t.py::long1", "t.py::long2"]
    assert a[3:] == [f"t.py::s{i}" for i in range(9)] and b[2:] == [f"t.py::s{i}" for i in range(9, 20)]


def test_one_worker_runs_the_long_tests_first_and_unknown_seconds_change_nothing():
    items = [item("a.py::x"), item("a.py::y"), item("b.py::z")]
    assert [i.nodeid for i in longest_first(items, 1, {"b.py::z": 5})] == ["b.py::z", "a.py::x", "a.py::y"]
    assert longest_first(items, 3, {}) == items


def test_tests_sharing_a_module_fixture_move_together():
    items = [item("m.py::a", "module"), item("m.py::plain"), item("m.py::b", "module"), item("n.py::c")]
    got = [i.nodeid for i in longest_first(items, 1, {"m.py::b": 30})]
    assert got == ["m.py::a", "m.py::b", "m.py::plain", "n.py::c"]
