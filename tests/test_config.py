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


@pytest.mark.parametrize("path", sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.toml")))
def test_every_shipped_config_is_valid_on_two_ranks(path):
    from dynmo import checks

    checks.validate(load_config(path), 2)
