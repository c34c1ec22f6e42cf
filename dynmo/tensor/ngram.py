"""A real sparse tensor from text: word n-gram counts.

Entry (w1, ..., wN) of the order-N tensor counts how often the words w1 .. wN follow each other
(within one file). Words are lower-cased runs of letters and apostrophes, numbered by first
appearance, so frequent words get small indices: the skew of real language (a few words in
most n-grams) is the tensor's. Made from the Shakespeare plays dynmo trains on, it is a tensor
nobody here wrote, and every machine with dynmo installed can make it again.
"""

from __future__ import annotations

import re

import numpy as np

from dynmo.tensor.coo import SparseTensor, from_coo, mixed_key

WORD = re.compile(r"[a-z']+")


def ngram_tensor(texts: list[str], order: int, name: str = "") -> SparseTensor:
    """The order-`order` n-gram count tensor of `texts` (one string per file)."""
    vocab: dict[str, int] = {}
    windows = []
    for text in texts:
        ids = np.fromiter((vocab.setdefault(w, len(vocab)) for w in WORD.findall(text.lower())), dtype=np.int64)
        if ids.size >= order:
            windows.append(np.lib.stride_tricks.sliding_window_view(ids, order))
    if not windows:
        raise ValueError(f"the text holds no run of {order} words")
    w = np.concatenate(windows).T  # (order, runs)
    n = len(vocab)
    key = mixed_key(list(w), [n] * order)
    srt = np.argsort(key, kind="stable")
    k = key[srt]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    counts = np.diff(np.append(starts, k.size)).astype(np.float64)
    return from_coo(w[:, srt[starts]], counts, name=name, check_duplicates=False)
