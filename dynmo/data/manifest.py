"""A prepared folder's manifest, read and checked before training reads the shards.

`check_prepared` is what `data.prepared` must pass before launch: every folder finished (its
manifest there), one tokenizer for all of them, the model's own when `model.hf_path` names one,
a vocabulary within `model.vocab_size`, and every shard's bytes matching the checksums the
manifest records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dynmo.data.corpus import DataError
from dynmo.data.shards import file_sha256
from dynmo.data.tokenizer import tokenizer_hash

FORMAT = 1
PLAN, MANIFEST, TOKENIZER = "plan.json", "manifest.json", "tokenizer.json"


def write_json(path: Path, obj: dict) -> None:
    """Atomically: a reader sees the whole file or none."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise DataError(f"data.prepared: {folder} does not exist; make it with `dynmo data prepare SRC... "
                        f"--tokenizer T --out {folder}`")
    if not path.is_file():
        raise DataError(f"{folder} has no {MANIFEST}: its preparation did not finish; run the same "
                        "`dynmo data prepare` command again to finish it")
    try:
        m = json.loads(path.read_text())
        ok = m["format"] == FORMAT and isinstance(m["shards"], list) and isinstance(m["tokenizer"]["sha256"], str)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise DataError(f"{path} is not a manifest of this dynmo (damaged, or another format); prepare the folder again")
    return m


def verify(folder: Path, manifest: dict) -> None:
    """Every shard's .bin and .idx hash to the manifest's checksums."""
    for s in manifest["shards"]:
        for ext in ("bin", "idx"):
            path = Path(folder) / f"{s['name']}.{ext}"
            if not path.is_file():
                raise DataError(f"{path} is missing; prepare the folder again")
            if file_sha256(path) != s[f"{ext}_sha256"]:
                raise DataError(f"{path} does not match its checksum in {MANIFEST} (truncated or damaged); "
                                "prepare the folder again")


def model_tokenizer_hash(hf_path: str) -> str | None:
    path = Path(hf_path) / "tokenizer.json" if hf_path else None
    return tokenizer_hash(path.read_bytes()) if path is not None and path.is_file() else None


def check_prepared(folders: list[str], weights: list[float], vocab_size: int, hf_path: str = "",
                   checksums: bool = True) -> list[dict]:
    """The manifests of `data.prepared`, each checked against the model and the others."""
    if weights and len(weights) != len(folders):
        raise DataError(f"data.weights has {len(weights)} values for {len(folders)} data.prepared folders; "
                        "give one weight per folder")
    if any(not (w > 0) for w in weights):
        raise DataError(f"data.weights must all be > 0, got {weights}")
    manifests = [read_manifest(Path(f)) for f in folders]
    want = model_tokenizer_hash(hf_path)
    first = manifests[0]["tokenizer"]["sha256"] if manifests else None
    for folder, m in zip(folders, manifests):
        tok = m["tokenizer"]
        if want is not None and tok["sha256"] != want:
            raise DataError(f"{folder} was prepared with another tokenizer than the model's ({hf_path}/tokenizer.json); "
                            f"prepare it with --tokenizer {hf_path}")
        if tok["sha256"] != first:
            raise DataError(f"{folder} was prepared with another tokenizer than {folders[0]}; prepare every "
                            "data.prepared folder with the same --tokenizer")
        if tok["vocab_size"] > vocab_size:
            raise DataError(f"{folder}'s tokenizer has {tok['vocab_size']} tokens, more than model.vocab_size "
                            f"{vocab_size}; set model.vocab_size to {tok['vocab_size']} or more")
        if checksums:
            verify(Path(folder), m)
    return manifests
