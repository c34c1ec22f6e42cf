"""Training data: where the text is, its preparation into token shards, and each step's batches.

    dynmo.data.corpus     where the text is: the bundled plays or the user's files (stdlib only,
                          so the pure tools find the same text the trainer reads)
    dynmo.data.sources    the documents of .txt/.md, .jsonl[.gz|.zst], .parquet, saved datasets
    dynmo.data.tokenizer  the tokenizer a preparation encodes with (a file, or bpe:N trained)
    dynmo.data.shards     one shard: Megatron's .bin/.idx, written by streaming, memory-mapped
    dynmo.data.encode     one worker of a preparation: its shards of the document stream
    dynmo.data.prepare    sources -> shards + manifest, in parallel, resumable, deterministic
    dynmo.data.manifest   a prepared folder's manifest, checked before training
    dynmo.data.tokens     data.paths (or the plays) -> a prepared folder in the cache
    dynmo.data.batches    `TokenData`: a blend of prepared folders, held-out documents, windows
    dynmo.data.cli        `dynmo data prepare`
"""
from dynmo.data.batches import TokenData
from dynmo.data.corpus import TEXT_SUFFIXES, DataError, corpus_files, default_corpus_dir
from dynmo.data.manifest import check_prepared
from dynmo.data.prepare import prepare_folder
from dynmo.data.tokens import cache_root, prepare

__all__ = ["TEXT_SUFFIXES", "DataError", "TokenData", "cache_root", "check_prepared", "corpus_files",
           "default_corpus_dir", "prepare", "prepare_folder"]
