"""`dynmo train` refuses, before anything starts, a run whose ranks cannot hold it.

The machine's figures are injected (`dynmo.machine`'s environment variables), so no test
depends on the memory of the machine it runs on.
"""

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from dynmo import checks
from dynmo.checks import footprint
from dynmo.checks.memory import check_memory
from dynmo.config import ConfigError, load_config
from tests.conftest import ROOT

CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.toml") if p.name != "tensor-grid.toml")
BIG = ["--model.d_model", "16384", "--model.n_heads", "16"]


@pytest.fixture
def machine(monkeypatch):
    """A CPU machine with `ram` available and no GPU."""
    def set_ram(ram: str):
        monkeypatch.setenv("DYNMO_MEMORY_AVAILABLE", ram)
        monkeypatch.setenv("DYNMO_GPU_FREE", "")
    set_ram("16G")
    return set_ram


def cfg_of(*overrides, config="configs/default.toml"):
    cfg = load_config(ROOT / config, list(overrides))
    checks.validate(cfg, 2)
    return cfg


@pytest.mark.parametrize("config", ["configs/default.toml", "configs/llama.toml", "configs/mixtral.toml",
                                    "configs/mod.toml", "configs/moe.toml"])
@pytest.mark.parametrize("unit", ["block", "sublayer"])
def test_parameter_counts_match_the_model(config, unit):
    from dynmo.model.layers import layer_param_counts

    cfg = cfg_of("--parallel.unit", unit, config=config)
    assert [n for n, _ in footprint.unit_params(cfg)] == layer_param_counts(cfg.model, unit)


def test_what_lowers_the_estimate_lowers_it():
    base = footprint.rank_memory(cfg_of(), 2)
    assert base.state == 16 * base.params
    ckpt = footprint.rank_memory(cfg_of("--train.activation_checkpointing", "all"), 2)
    assert ckpt.activations < base.activations / 3 and ckpt.total < base.total
    small = footprint.rank_memory(cfg_of("--train.microbatches", "8"), 2)
    assert small.activations < base.activations
    cfg = load_config(ROOT / "configs/default.toml", ["--parallel.dp", "2", "--parallel.shard", "full"])
    checks.validate(cfg, 4)
    assert footprint.rank_memory(cfg, 4).state == base.state / 2
    gpipe = footprint.rank_memory(cfg_of("--parallel.schedule", "gpipe"), 2)
    assert gpipe.activations > base.activations


def test_too_big_is_refused_in_one_line_naming_both_figures_and_the_ways_out(machine):
    cfg = cfg_of("--model.d_model", "4096", "--model.n_heads", "16")
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, 2, 2)
    msg = str(e.value)
    assert "\n" not in msg and "8.00 GB" in msg and "16.00 GB of RAM available over 2 ranks" in msg
    assert footprint.gb(footprint.rank_memory(cfg, 2).total) in msg
    for way in ("more ranks", "--parallel.shard full", "--train.preflight false"):
        assert way in msg
    cfg.train.preflight = False
    check_memory(cfg, 2, 2)  # skipped


def test_a_run_that_fits_passes(machine):
    check_memory(cfg_of(), 2, 2)
    machine("1M")
    with pytest.raises(ConfigError, match="a rank has 512 KB|needs about"):
        check_memory(cfg_of(), 2, 2)


def test_the_gpu_figure_is_used_when_the_driver_lists_gpus(monkeypatch, machine):
    monkeypatch.setenv("DYNMO_GPU_FREE", "80G,1G")
    cfg = cfg_of("--model.d_model", "1024")
    with pytest.raises(ConfigError, match=r"GPU 1 has 1.00 GB free \(the least of 2\)"):
        check_memory(cfg, 2, 2)
    cfg.parallel.backend = "gloo"  # the ranks compute on the CPU: RAM decides
    check_memory(cfg, 2, 2)


def test_a_forced_relayout_or_a_balancer_cap_that_overfills_a_rank_is_refused(machine):
    cfg = cfg_of("--model.d_model", "1024")
    have = footprint.rank_memory(cfg, 2).total
    machine(str(int(have * 2 * 1.2)))  # fits as laid out, not with every block on one rank
    check_memory(cfg, 2, 2)
    cfg.parallel.relayout = ["2:0,9,10"]
    with pytest.raises(ConfigError, match="parallel.relayout at step 2"):
        check_memory(cfg, 2, 2)
    cfg.parallel.relayout = []
    cfg.balance.when, cfg.balance.memory_gb = "every", 100.0
    with pytest.raises(ConfigError, match="balance.memory_gb = 100 lets the balancer fill a rank to 100.00 GB"):
        check_memory(cfg, 2, 2)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_fits_a_small_machine(config, machine):
    machine("8G")
    for world in (2, 4):
        cfg = load_config(config)
        try:
            checks.validate(cfg, world)
        except ConfigError:
            continue  # the config asks for another world size
        check_memory(cfg, world, world)
        return
    pytest.fail(f"{config.name} validates on neither 2 nor 4 ranks")


def test_the_launcher_refuses_before_anything_is_written(tmp_path, machine):
    from dynmo import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["train", "--nproc", "2", "--config", "configs/default.toml", "--out",
                         str(tmp_path / "run"), *BIG])
    assert code == 2 and not (tmp_path / "run").exists()
    assert err.getvalue().count("\n") == 1 and "needs about" in err.getvalue()


def test_the_launcher_process_refuses_a_huge_model(tmp_path):
    env = {"DYNMO_MEMORY_AVAILABLE": "24G", "DYNMO_GPU_FREE": ""}
    p = subprocess.run([sys.executable, "-m", "dynmo.cli", "train", "--nproc", "2", "--config",
                        "configs/default.toml", "--out", str(tmp_path / "run"), "--model.d_model", "1000000"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env={**_env(), **env})
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "TB" in p.stderr
    assert not Path(tmp_path / "run").exists()


def _env():
    import os

    return dict(os.environ)
