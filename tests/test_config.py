import re
from pathlib import Path

import pytest

from dynmo.config import ConfigError, load_config, to_toml


def test_overrides_and_types(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('out = "x"\n[model]\nd_model = 64\n[train]\nlr = 0.01\n[parallel]\nrelayout = ["3:0,2,6"]\n')
    cfg = load_config(f, ["--train.steps", "7", "--model.n_layers=3", "--log.tensorboard", "false",
                          "--parallel.relayout", "1:0,1,5;2:0,2,5"])
    assert cfg.model.d_model == 64 and cfg.model.n_layers == 3 and cfg.train.steps == 7
    assert cfg.train.lr == 0.01 and cfg.log.tensorboard is False and cfg.out == "x"
    assert cfg.parallel.relayout == ["1:0,1,5", "2:0,2,5"]


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["--train.steps", "3", "--parallel.relayout", "1:0,1,5", "--data.paths", "a.txt"])
    f = tmp_path / "c.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("args,msg", [
    (["--nosection", "1"], "unknown option"),
    (["--train.nofield", "1"], "unknown field train.nofield"),
    (["--train.steps", "many"], "expected int"),
    (["--train.steps"], "needs a value"),
    (["--log.tensorboard", "maybe"], "expected true/false"),
    (["stray"], "unexpected argument"),
])
def test_errors_name_the_problem(args, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, args)


def test_nested_sections(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nblock = "moe"\n[model.moe]\nnum_experts = 4\n[prune]\nenabled = true\n')
    cfg = load_config(f, ["--model.moe.top_k", "1", "--model.mod.capacities", "0.5;0.25"])
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.top_k == 1 and cfg.prune.enabled
    assert cfg.model.mod.capacities == [0.5, 0.25]
    g = tmp_path / "d.toml"
    g.write_text(to_toml(cfg))
    assert load_config(g).to_dict() == cfg.to_dict()
    with pytest.raises(ConfigError, match="model.moe is a section"):
        load_config(None, ["--model.moe", "3"])
    with pytest.raises(ConfigError, match="unknown field model.moe.experts"):
        load_config(None, ["--model.moe.experts", "3"])


# every training config (configs/tensor-*.toml are grids of `dynmo tensor dataset`, not training runs)
@pytest.mark.parametrize("path", sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.toml")
                                        if not p.name.startswith("tensor-")))
def test_every_shipped_config_is_valid_on_two_ranks(path):
    from dynmo import checks

    checks.validate(load_config(path), 2)


def test_new_fields_override_render_and_load(tmp_path):
    cfg = load_config(None, ["--parallel.timeout_s", "60", "--checkpoint.keep", "2", "--overwrite", "true"])
    assert cfg.parallel.timeout_s == 60.0 and cfg.checkpoint.keep == 2 and cfg.overwrite is True
    text = to_toml(cfg)
    assert "\noverwrite = true\n" in text and "timeout_s = 60.0" in text and "keep = 2" in text
    assert text.index("overwrite = true") < text.index("[model]")  # bare keys before the first table
    f = tmp_path / "c.toml"
    f.write_text(text)
    assert load_config(f).to_dict() == cfg.to_dict()
    # a file written before these fields existed loads with their defaults
    old = tmp_path / "old.toml"
    old.write_text('out = "runs/x"\n[parallel]\nbackend = "gloo"\n[checkpoint]\nevery = 3\n')
    cfg = load_config(old)
    assert (cfg.parallel.timeout_s, cfg.checkpoint.keep, cfg.overwrite) == (300.0, 0, False)
    g = tmp_path / "top.toml"
    g.write_text("overwrite = true\n[checkpoint]\nkeep = 1\n")
    assert load_config(g).overwrite is True and load_config(g).checkpoint.keep == 1
    with pytest.raises(ConfigError, match="expected true/false"):
        load_config(None, ["--overwrite", "maybe"])
    with pytest.raises(ConfigError, match=r"unknown option 'overwrit'.*'out', 'overwrite'"):
        load_config(None, ["--overwrit", "true"])


def _float_fields(obj=None, prefix=""):
    """Dotted names of every float (or list of floats) field of the config."""
    import dataclasses
    import typing

    from dynmo.config import Config

    obj = Config() if obj is None else obj
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _float_fields(v, f"{prefix}{f.name}.")
        elif hints[f.name] in (float, list[float]):
            yield f"{prefix}{f.name}"


TINY_MODEL = ["--model.n_layers", "4", "--model.d_model", "64", "--model.n_heads", "2", "--model.seq_len", "32",
              "--train.global_batch", "8"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", sorted(_float_fields()))
def test_every_float_field_must_be_finite(name, value):
    from dynmo import checks

    cfg = load_config(None, [*TINY_MODEL, f"--{name}", value])
    with pytest.raises(ConfigError, match=f"^{name}=.*{value} is not a finite number$"):
        checks.validate(cfg, 2)


def test_the_walk_finds_the_float_fields():
    names = set(_float_fields())
    assert {"train.lr", "parallel.timeout_s", "balance.speeds", "model.mod.capacities", "noise.jitter"} <= names
    assert "train.steps" not in names and "overwrite" not in names


def test_bounds_read_as_intervals():
    from dynmo.checks import require

    require("a", 0.5, ge=0, lt=1)
    for kwargs, rule in [({"ge": 0, "lt": 1}, "in [0, 1)"), ({"gt": 0, "le": 1}, "in (0, 1]"), ({"ge": 1}, ">= 1"),
                         ({"gt": 0}, "> 0"), ({"le": 2}, "<= 2"), ({"lt": 2}, "< 2")]:
        with pytest.raises(ConfigError, match=fr"^x=nan must be {re.escape(rule)} \(why\)$"):
            require("x", float("nan"), **kwargs, why="why")


def test_layer_names_without_torch_match_the_model():
    from dynmo import plan
    from dynmo.model.layers import layer_specs

    for n in (1, 4, 12):
        cfg = load_config(None, ["--model.n_layers", str(n)])
        assert plan.layer_names(cfg) == [s.name for s in layer_specs(cfg.model)]
