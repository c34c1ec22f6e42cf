"""Arguments that several `dynmo tensor` commands share, defined once, and the checks and writes of their
output files."""

from __future__ import annotations

import os
from pathlib import Path

from dynmo.jsonio import InputError

TNS_HELP = "a FROSTT .tns file (1-based indices, the value last; gzip too)"


def header(p) -> None:
    """--header: the file starts with an order line and a sizes line."""
    p.add_argument("--header", dest="header", action="store_const", const=True, default=None,
                   help="the file starts with an order line and a sizes line (detected when left out)")


def overwrite(p, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace {what} if it exists")


def tensor_file(p, header_too: bool = True) -> None:
    """FILE (a .tns file) and, unless told otherwise, --header."""
    p.add_argument("file", help=TNS_HELP)
    if header_too:
        header(p)


def check_out(path: str | None, overwrite: bool, flag: str) -> None:
    """Refuse, before any work, an output `path` that exists (unless `overwrite`), is a folder or has no folder."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give a file name")
    if p.exists() and not overwrite:
        raise InputError(f"{flag} {path} exists; pass --overwrite to replace it, or choose another name")
    if not p.parent.is_dir():
        raise InputError(f"{flag} {path}: the folder {str(p.parent)!r} does not exist")


def write(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file, then a rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
