"""Training data: where the text is, its tokens, and the batches every rank draws.

    dynmo.data.corpus   where the text is: the bundled plays or the user's files (stdlib only,
                        so the pure tools find the same text the trainer reads)
    dynmo.data.tokens   text -> byte-level BPE tokens, cached -> `TokenData`, each step's windows
"""
from dynmo.data.corpus import TEXT_SUFFIXES, DataError, corpus_files, default_corpus_dir
from dynmo.data.tokens import TokenData, cache_root, prepare

__all__ = ["TEXT_SUFFIXES", "DataError", "TokenData", "cache_root", "corpus_files", "default_corpus_dir", "prepare"]
