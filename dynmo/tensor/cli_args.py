"""Arguments that several `dynmo tensor` commands share, defined once."""

from __future__ import annotations

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
