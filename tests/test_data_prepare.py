"""`dynmo data prepare`: every format, the shard layout against a brute-force encoding, the same
bytes for any --workers and after a kill, and bad input refused with nothing written."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from dynmo.data import DataError, prepare_folder
from dynmo.data.shards import Shard, read_index
from dynmo.data.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bears".split()


def docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) + ("." if i % 3 else " ünïcode ✓")
            for i in range(n)]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe(300, docs(200, 9)).blob)
    return path


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    blob = "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)).encode()
    if path.name.endswith(".gz"):
        blob = gzip.compress(blob, mtime=0)
    elif path.name.endswith(".zst"):
        import zstandard

        blob = zstandard.ZstdCompressor().compress(blob)
    path.write_bytes(blob)
    return path


def shard_docs(folder: Path) -> list[list[int]]:
    m = json.loads((folder / "manifest.json").read_text())
    out = []
    for s in m["shards"]:
        sh = Shard.open(folder, s["name"], s["tokens"])
        out += [sh.tokens[a : a + n].tolist() for a, n in zip(sh.starts, sh.lengths)]
    return out


def brute(tok_path: Path, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    return [tok.encode(t).ids + [eos] for t in texts]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "manifest.json"}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_shards_hold_each_document_then_eos(tmp_path, tok_file, suffix):
    texts = docs(300)
    src = write_jsonl(tmp_path / f"c{suffix}", texts)
    m = prepare_folder([str(src)], str(tok_file), str(tmp_path / "out"), workers=1, shard_mb=0.004, quiet=True)
    assert shard_docs(tmp_path / "out") == brute(tok_file, texts)
    assert m["docs"] == 300 and len(m["shards"]) > 3 and m["dtype"] == "uint16"
    dtype, lengths = read_index(tmp_path / "out" / "shard-00000.idx")
    assert dtype == np.uint16 and lengths.sum() == m["shards"][0]["tokens"]


def test_a_checkpoint_post_processor_runs_on_every_document(tmp_path, tok_file):
    """A Llama-style tokenizer starts each document with <s>: the shards hold encode()'s ids."""
    from tokenizers import AddedToken
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(str(tok_file))
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tok.save(str(ckpt / "tokenizer.json"))
    texts = docs(120, 3)
    src = write_jsonl(tmp_path / "c.jsonl", texts)
    prepare_folder([str(src)], str(ckpt), str(tmp_path / "out"), workers=1, shard_mb=0.003, quiet=True)
    got = shard_docs(tmp_path / "out")
    assert got == brute(ckpt / "tokenizer.json", texts)
    assert all(d[0] == tok.token_to_id("<s>") for d in got)


def test_text_parquet_and_saved_dataset(tmp_path, tok_file):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = docs(40, 1)
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, t in enumerate(texts[:5]):
        (folder / f"{i:02d}.md").write_text(t)
    pq.write_table(pa.table({"body": texts[5:25]}), tmp_path / "p.parquet", row_group_size=7)
    saved = tmp_path / "saved"
    saved.mkdir()
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as f, \
            pa.ipc.new_stream(f, pa.schema([("body", pa.string())])) as w:
        w.write_table(pa.table({"body": texts[25:]}), max_chunksize=4)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (saved / "dataset_info.json").write_text("{}")
    out = tmp_path / "out"
    prepare_folder([str(folder), str(tmp_path / "p.parquet"), str(saved)], str(tok_file), str(out), field="body",
                   workers=2, shard_mb=0.001, quiet=True)
    assert shard_docs(out) == brute(tok_file, texts)


def test_any_workers_and_a_killed_run_give_the_same_bytes(tmp_path, tok_file):
    src = write_jsonl(tmp_path / "c.jsonl.zst", docs(400, 2))
    args = dict(field="text", shard_mb=0.003, quiet=True)
    prepare_folder([str(src)], str(tok_file), str(tmp_path / "one"), workers=1, **args)
    prepare_folder([str(src)], str(tok_file), str(tmp_path / "two"), workers=2, **args)
    prepare_folder([str(src)], str(tok_file), str(tmp_path / "three"), workers=3, **args)
    one = files_of(tmp_path / "one")
    assert one == files_of(tmp_path / "two") == files_of(tmp_path / "three")
    assert len([n for n in one if n.endswith(".bin")]) >= 6
    # a kill leaves finished shards, a half-written one (.part) and no manifest; the rerun finishes it
    killed = tmp_path / "killed"
    prepare_folder([str(src)], str(tok_file), str(killed), workers=2, **args)
    (killed / "manifest.json").unlink()
    for name in ("shard-00001", "shard-00004"):
        (killed / f"{name}.json").unlink()
        (killed / f"{name}.idx").unlink()
        os.replace(killed / f"{name}.bin", killed / f"{name}.bin.part")
    (killed / "shard-00001.bin.part").write_bytes(b"half")
    prepare_folder([str(src)], str(tok_file), str(killed), workers=1, **args)
    assert files_of(killed) == one
    # done: the same command again returns the manifest and writes nothing
    before = {p.name: p.stat().st_mtime_ns for p in killed.iterdir()}
    prepare_folder([str(src)], str(tok_file), str(killed), workers=2, **args)
    assert {p.name: p.stat().st_mtime_ns for p in killed.iterdir()} == before


def test_bpe_is_trained_once_and_vocab_over_65536_is_32_bit(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", docs(60, 3))
    m = prepare_folder([str(src)], "bpe:300", str(tmp_path / "out"), workers=1, quiet=True)
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert m["tokenizer"]["eos"] == tok.token_to_id("<|endoftext|>") == 0
    assert all(d[-1] == 0 and 0 not in d[:-1] for d in shard_docs(tmp_path / "out"))
    from dynmo.data.shards import token_dtype

    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.int32


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynmo.cli", "data", "prepare", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, tok_file):
    good = write_jsonl(tmp_path / "c.jsonl", docs(20, 4))
    other = write_jsonl(tmp_path / "o.jsonl", docs(20, 5), field="body")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    out = tmp_path / "out"
    cases = [
        ([str(other), "--tokenizer", str(tok_file)], "has no field 'text'"),
        ([str(empty), "--tokenizer", str(tok_file)], "hold no text"),
        ([str(tmp_path / "nope.jsonl"), "--tokenizer", str(tok_file)], "does not exist"),
        ([str(good), "--tokenizer", str(tmp_path)], "no tokenizer.json there"),
        ([str(good), "--tokenizer", "bpe:x"], "bpe:N needs"),
    ]
    for args, msg in cases:
        p = cli(*args, "--out", str(out), "--quiet")
        assert p.returncode == 2 and msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not out.exists()
    p = cli(str(good), "--tokenizer", str(tok_file), "--out", str(tmp_path / "busy"), "--quiet")
    assert p.returncode == 2 and "not a preparation's (notes.txt)" in p.stderr
    assert sorted(os.listdir(tmp_path / "busy")) == ["notes.txt"]
    assert cli(str(good), "--tokenizer", str(tok_file), "--out", str(out), "--quiet").returncode == 0
    p = cli(str(other), "--field", "body", "--tokenizer", str(tok_file), "--out", str(out), "--quiet")
    assert p.returncode == 2 and "a preparation of other sources" in p.stderr
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a b c"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match="has no column 'text'"):
        prepare_folder([str(tmp_path / "p.parquet")], str(tok_file), str(tmp_path / "out2"), workers=1, quiet=True)
    assert not (tmp_path / "out2").exists()
    with pytest.raises(DataError, match="more than model.vocab_size 100"):
        prepare_folder([str(good)], str(tok_file), str(tmp_path / "out3"), max_vocab=100, quiet=True)
    assert not (tmp_path / "out3").exists()


def test_a_bad_line_deep_in_the_stream_removes_what_the_run_wrote(tmp_path, tok_file):
    src = tmp_path / "c.jsonl"
    write_jsonl(src, docs(50, 6))
    with open(src, "a") as f:
        f.write(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(DataError, match="line 51, has no field 'text'"):
        prepare_folder([str(src)], str(tok_file), str(tmp_path / "out"), workers=2, quiet=True)
    assert not (tmp_path / "out").exists()


def test_too_little_memory_or_disk_is_refused_before_anything_is_written(tmp_path, tok_file, monkeypatch):
    texts = docs(300, 6)
    good = write_jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "out"
    env = {**os.environ, "DYNMO_MEMORY_AVAILABLE": "512M"}
    p = subprocess.run([sys.executable, "-m", "dynmo.cli", "data", "prepare", str(good), "--tokenizer", str(tok_file),
                        "--out", str(out), "--quiet", "--memory-gb", "1"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "--memory-gb 1 asks for 1.00 GB but 0.50 GB" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not out.exists()
    # The shards' bytes, as the tokenizer encodes the whole text: the estimate holds them, within its margin.
    n_tokens = sum(len(ids) for ids in brute(tok_file, texts))
    monkeypatch.setenv("DYNMO_DISK_FREE", str(n_tokens))  # half of what the uint16 shards take
    with pytest.raises(DataError, match="the shards need about .* free"):
        prepare_folder([str(good)], str(tok_file), str(out), workers=1, quiet=True)
    assert not out.exists()
    monkeypatch.setenv("DYNMO_DISK_FREE", str(good.stat().st_size * 4))  # room for 2 bytes a token of every byte
    prepare_folder([str(good)], str(tok_file), str(out), workers=1, quiet=True)
    assert sum(p.stat().st_size for p in out.glob("shard-*.bin")) == n_tokens * 2
