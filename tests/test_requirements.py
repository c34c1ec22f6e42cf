"""The PyTorch version check (dynmo.requirements) and its use by `dynmo VERB`.

Versions are injected (no real downgrade): the comparison is a pure function, and the CLI test
swaps the function that reads the installed version.
"""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dynmo import cli, requirements
from dynmo.requirements import MIN_TORCH, parse_release, torch_problem

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version, release", [
    ("2.13.0", (2, 13, 0)),
    ("2.13.0+cpu", (2, 13, 0)),
    ("2.7.0a0+79aa17489c.nv25.04", (2, 7, 0)),  # NVIDIA container builds
    ("2.8.0.dev20250301+cu128", (2, 8, 0)),  # a nightly
    ("v2.9", (2, 9)),
    ("10.1", (10, 1)),
    ("unknown", None),
    ("", None),
])
def test_parse_release(version, release):
    assert parse_release(version) == release


@pytest.mark.parametrize("version", ["2.7.0", "2.7", "2.7.0a0+79aa17489c", "2.7.1+cu126", "2.13.0+cpu", "2.14.1",
                                     "3.0.0"])
def test_supported_versions_have_no_problem(version):
    assert torch_problem(version) is None


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0a0+ecf3bae40a", "2.5.1+cu124", "2.4", "1.13.1", "0.4.1"])
def test_older_versions_name_the_version_and_the_fix(version):
    problem = torch_problem(version)
    assert problem is not None and "\n" not in problem
    assert version in problem and "torch>=2.7" in problem and "pip install" in problem


def test_missing_and_unreadable_torch():
    assert "not installed" in torch_problem(None) and "pip install" in torch_problem(None)
    assert "cannot read" in torch_problem("nightly") and "torch>=2.7" in torch_problem("nightly")


def test_the_torch_installed_here_passes():
    assert requirements.check_torch() is None


def test_lower_bound_matches_pyproject():
    """MIN_TORCH and pyproject.toml's torch requirement say the same release, and the
    requirement is a range (an exact pin would replace a user's CUDA build of PyTorch)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(r"torch\b", d)]
    assert "==" not in spec, spec
    lower = re.search(r">=\s*([^,\s]+)", spec)
    assert lower, f"no lower bound in {spec!r}"
    assert parse_release(lower.group(1))[:2] == MIN_TORCH
    assert re.search(r"<\s*\d", spec), f"no upper bound in {spec!r}"


def test_module_is_stdlib_only():
    code = ("import sys, dynmo.requirements as r; r.check_torch(); "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("verb", ["train", "export"])
def test_cli_refuses_an_old_torch_with_one_line(monkeypatch, capsys, verb):
    monkeypatch.setattr(requirements, "installed_torch_version", lambda: "2.5.1+cu121")
    assert cli.main([verb, "--config", "configs/default.toml"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith("dynmo: error: PyTorch 2.5.1+cu121 is too old") and "pip install" in line


def test_cli_refuses_a_missing_torch(monkeypatch, capsys):
    monkeypatch.setattr(requirements, "installed_torch_version", lambda: None)
    assert cli.main(["train"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("dynmo: error: PyTorch is not installed")


def test_pure_verbs_do_not_check_torch(monkeypatch, capsys):
    """`dynmo simulate` and `dynmo balance` run without torch: an old one does not stop them."""
    def fail():
        raise AssertionError("a pure verb asked for the torch version")

    monkeypatch.setattr(requirements, "installed_torch_version", fail)
    for verb in ("simulate", "balance"):
        try:
            status = cli.main([verb, "--help"])
        except SystemExit as e:  # argparse's --help
            status = e.code
        assert status == 0
        assert f"dynmo {verb}" in capsys.readouterr().out
