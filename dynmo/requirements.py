"""The PyTorch release dynmo needs, checked without importing torch (stdlib only).

`dynmo train` and `dynmo export` check it before anything else (`dynmo.cli`; `dynmo bench`
trains through `dynmo train`), so an old or missing PyTorch is one line that says what to
install, instead of a TypeError from deep inside `torch.distributed.pipelining` on every rank.
The workers (`torchrun -m dynmo.train`, launched by hand on a cluster) do not check it yet.
The version comes from the installed distribution's metadata: milliseconds, where importing
torch takes seconds.

The lower bound is the one in pyproject.toml (tests/test_requirements.py keeps the two equal);
pyproject.toml says why it is that release.
"""

from __future__ import annotations

import importlib.metadata
import re

MIN_TORCH = (2, 7)  # oldest (major, minor) with every torch API dynmo calls; = pyproject.toml's lower bound
TESTED_TORCH = "2.13.0"  # the release CI installs and every measurement in the docs was taken with

# The numeric release at the start of a version: "2.13.0+cpu" -> 2.13.0, "2.7.0a0+<commit>"
# (NVIDIA's containers) -> 2.7.0, "v2.8" -> 2.8.
_RELEASE = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def parse_release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string, or None if it does not start with one.

    Pre-release, development and local parts are ignored: a `2.7.0a0` build is taken as 2.7,
    as pyproject.toml's `torch>=2.7.0a0` admits it (NVIDIA's PyTorch containers ship such
    builds of the upcoming release)."""
    m = _RELEASE.match(version)
    return tuple(int(part) for part in m.group(1).split(".")) if m else None


def installed_torch_version() -> str | None:
    """The installed torch's version from its package metadata (torch is not imported); None
    when no torch distribution is installed."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_problem(version: str | None) -> str | None:
    """What is wrong with a PyTorch of this version (None = not installed) for dynmo, as one
    line naming the fix; None when it is a release dynmo supports."""
    need = ".".join(map(str, MIN_TORCH))
    fix = (f"install torch>={need} (keep a CUDA build you already have if it is that new; "
           f"pip install torch=={TESTED_TORCH} is the release dynmo is tested with), then pip install -e .")
    if version is None:
        return f"PyTorch is not installed; {fix}"
    release = parse_release(version)
    if release is None:
        return f"cannot read the installed PyTorch's version {version!r}; dynmo needs torch>={need}: {fix}"
    if release[:2] < MIN_TORCH:
        return (f"PyTorch {version} is too old: dynmo needs torch>={need} (its pipeline schedules take "
                f"scale_grads); {fix}")
    return None


def check_torch() -> str | None:
    """`torch_problem` for the PyTorch installed here."""
    return torch_problem(installed_torch_version())
