"""The tokenizer a preparation encodes with, and its end-of-document token.

`--tokenizer` takes a Hugging Face checkpoint folder (its tokenizer.json, its EOS from
tokenizer_config.json), a tokenizer.json file, or `bpe:N`: a byte-level BPE of N tokens
(`<|endoftext|>` among them, id 0) trained on a bounded sample of the sources, their first
`SAMPLE_BYTES` characters of text in order. The tokenizer is named by the SHA-256 of its JSON, which the
manifest records and training compares with the model's.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dynmo.data.corpus import DataError

SAMPLE_BYTES = 64 << 20
BPE_EOS = "<|endoftext|>"
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


@dataclass
class TokenizerInfo:
    blob: str  # the tokenizer's JSON
    eos: int
    vocab_size: int

    @property
    def sha256(self) -> str:
        return tokenizer_hash(self.blob.encode())


def tokenizer_hash(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def _eos_id(tok, folder: Path | None, where: str) -> int:
    names: list[str] = []
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.append(eos)
    for name in [*names, *EOS_NAMES]:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise DataError(f"{where} has no end-of-document token (none of {', '.join(EOS_NAMES)}, nor an eos_token in "
                    "tokenizer_config.json); use a tokenizer that has one, or bpe:N")


def from_file(spec: str) -> TokenizerInfo:
    """A checkpoint folder's or a file's tokenizer.json."""
    from tokenizers import Tokenizer

    p = Path(spec)
    folder = p if p.is_dir() else (p.parent if p.is_file() else None)
    path = p / "tokenizer.json" if p.is_dir() else p
    if not path.is_file():
        raise DataError(f"--tokenizer {spec}: no tokenizer.json there (give a Hugging Face checkpoint folder, "
                        "a tokenizer.json file, or bpe:N)")
    blob = path.read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(blob)
    except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
        raise DataError(f"{path} is not a tokenizer the tokenizers library reads ({e})") from None
    return TokenizerInfo(blob, _eos_id(tok, folder, str(path)), tok.get_vocab_size(with_added_tokens=True))


def train_bpe(vocab_size: int, texts: Iterable[str]) -> TokenizerInfo:
    """A byte-level BPE of `vocab_size` tokens (id 0 the EOS) trained on `texts`, the sample."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False,
                            special_tokens=[BPE_EOS])
    if tok.get_vocab_size() > vocab_size:
        raise DataError(f"the BPE trained to {tok.get_vocab_size()} > {vocab_size} tokens; ask for more with bpe:N")
    blob = tok.to_str()
    return TokenizerInfo(blob, int(tok.token_to_id(BPE_EOS)), tok.get_vocab_size())


def sample(texts: Iterable[str], limit: int = SAMPLE_BYTES) -> Iterable[str]:
    """The first `limit` bytes of text, whole documents (the last one cut)."""
    left = limit
    for t in texts:
        if left <= 0:
            return
        yield t[:left]
        left -= len(t)


def resolve(spec: str, texts: Iterable[str]) -> TokenizerInfo:
    """`--tokenizer`'s value as a tokenizer; `texts` (lazy) is read only to train bpe:N."""
    if spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            n = 0
        if n < 258:
            raise DataError(f"--tokenizer {spec}: bpe:N needs a whole N >= 258 (256 bytes, EOS, one merge)")
        print(f"dynmo: training a {n}-token byte-level BPE on the first {SAMPLE_BYTES >> 20} M characters of the sources",
              file=sys.stderr, flush=True)
        return train_bpe(n, sample(texts))
    return from_file(spec)
