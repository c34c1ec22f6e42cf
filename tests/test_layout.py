from hypothesis import given, strategies as st

import pytest

from dynmo.layout import Layout, LayoutError, imbalance


@st.composite
def layouts(draw, n=None):
    n = n or draw(st.integers(1, 40))
    p = draw(st.integers(1, n))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=p - 1, max_size=p - 1))) if p > 1 else []
    return Layout(tuple([0, *cuts, n]))


@given(st.data())
def test_moves_take_one_layout_to_the_other(data):
    a = data.draw(layouts())
    b = data.draw(layouts(n=a.num_layers))
    owner = a.owner()
    for mv in a.moves_to(b):
        assert owner[mv.layer] == mv.src
        owner[mv.layer] = mv.dst
    if a.num_stages == b.num_stages:
        assert owner == b.owner()
    assert sum(a.sizes) == a.num_layers
    assert all(a.stage_of(i) == a.owner()[i] for i in range(a.num_layers))


def test_parse_and_format():
    lay = Layout.parse("4+4+3")
    assert lay.boundaries == (0, 4, 8, 11) and Layout.parse("[0, 4, 8, 11]") == lay
    kinds = ["E"] + ["t"] * 9 + ["L"]
    assert lay.format(kinds) == "E t t t | t t t t | t t L"
    assert Layout.uniform(11, 3).sizes == [4, 4, 3]
    assert imbalance([1.0, 1.0]) == 0.0 and imbalance([1.0, 3.0]) == 1.0


@pytest.mark.parametrize("bad", ["0,3,3,6", "1,3,6", "0", "a,b"])
def test_invalid_layouts(bad):
    with pytest.raises(LayoutError):
        Layout.parse(bad)
