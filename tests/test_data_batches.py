"""Training on prepared folders: windows equal to a brute-force reading of the shards, a 3:1 blend
drawn in that ratio, validation from held-out documents, the same windows after a restart,
and the folders' checks (tokenizer, vocabulary, checksums)."""

import json
from pathlib import Path

import numpy as np
import pytest

from dynmo.data import DataError, TokenData, check_prepared, prepare_folder
from dynmo.data.batches import held_out
from dynmo.data.tokenizer import train_bpe

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def corpus(path: Path, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, size=int(rng.integers(20, 80))))}) + "\n"
                            for _ in range(n)))
    return path


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("prep")
    tok = root / "tokenizer.json"
    tok.write_text(train_bpe(280, [" ".join(WORDS)] * 20).blob)
    a, b = root / "a", root / "b"
    prepare_folder([str(corpus(root / "a.jsonl", 300, 1))], str(tok), str(a), workers=1, shard_mb=0.01, quiet=True)
    prepare_folder([str(corpus(root / "b.jsonl", 120, 2))], str(tok), str(b), workers=1, shard_mb=0.01, quiet=True)
    return a, b, tok


def stream_by_hand(folder: Path, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The train and validation streams, read document by document from the raw files."""
    m = json.loads((folder / "manifest.json").read_text())
    doc_list = []
    for s in m["shards"]:
        ids = np.fromfile(folder / f"{s['name']}.bin", dtype=np.uint16)
        lens = np.frombuffer((folder / f"{s['name']}.idx").read_bytes(), dtype="<i4", count=s["docs"], offset=34)
        doc_list += np.split(ids, np.cumsum(lens)[:-1])
    val = held_out(len(doc_list), fraction)
    return (np.concatenate([d for d, v in zip(doc_list, val) if not v]),
            np.concatenate([d for d, v in zip(doc_list, val) if v]))


def test_windows_are_the_held_out_split_read_by_hand(two):
    a, _, _ = two
    data = TokenData.load(a, seq_len=16, val_fraction=0.1, seed=3)
    train, val = stream_by_hand(a, 0.1)
    assert data.train[0].total == train.size and data.val[0].total == val.size
    assert 0 < val.size < 0.2 * (train.size + val.size)
    for step in range(5):
        for split, ref in (("train", train), ("val", val)):
            rng = np.random.default_rng([3, 0 if split == "train" else 1, step])
            starts = rng.integers(0, ref.size - 17, size=8)
            expect = np.stack([ref[s : s + 17] for s in starts]).astype(np.int64)
            assert np.array_equal(data.batch(step, 8, split), expect)
    # every window position: across runs and shards
    s = data.train[0]
    for pos in range(0, train.size - 17, 97):
        assert np.array_equal(s.window(pos, 17), train[pos : pos + 17])


def test_held_out_documents_are_chosen_by_hash():
    flags = held_out(100_000, 0.05)
    assert abs(flags.mean() - 0.05) < 0.003
    assert np.array_equal(held_out(1000, 0.05), flags[:1000])  # a document's fate is its own index's
    assert held_out(3, 0.01).sum() == 1  # at least one
    assert not held_out(10, 0.0).any()


def test_a_3_to_1_blend_draws_in_that_ratio_and_restarts_onto_the_same_windows(two):
    a, b, _ = two
    data = TokenData.load([a, b], seq_len=16, val_fraction=0.05, seed=0, weights=[3, 1])
    src = np.concatenate([data.sources(step, 8) for step in range(125)])  # 1,000 windows
    share = (src == 0).mean()
    assert abs(share - 0.75) <= 0.02 * 0.75, share
    # the tokens of each window come from the folder it was drawn from: a's and b's windows by hand
    ta, tb = stream_by_hand(a, 0.05)[0], stream_by_hand(b, 0.05)[0]
    tokens = {0: 0, 1: 0}
    for step in range(125):
        batch = data.batch(step, 8)
        rng = np.random.default_rng([0, 0, step])
        s = data.sources(step, 8)
        starts = rng.integers(0, np.asarray([(ta.size, tb.size)[i] - 17 for i in s]))
        for row, i, p in zip(batch, s, starts):
            assert np.array_equal(row, (ta, tb)[i][p : p + 17])
            tokens[int(i)] += row.size
    assert abs(tokens[0] / (tokens[0] + tokens[1]) - 0.75) <= 0.015
    # a restarted run (a fresh load) draws the same windows at the same steps
    again = TokenData.load([a, b], seq_len=16, val_fraction=0.05, seed=0, weights=[3, 1])
    for step in (0, 7, 124):
        assert np.array_equal(again.batch(step, 8), data.batch(step, 8))


def test_prepared_folders_are_checked(two, tmp_path):
    a, b, tok = two
    assert len(check_prepared([str(a), str(b)], [3, 1], vocab_size=512)) == 2
    with pytest.raises(DataError, match="more than model.vocab_size 100"):
        check_prepared([str(a)], [], vocab_size=100)
    with pytest.raises(DataError, match="one weight per folder"):
        check_prepared([str(a), str(b)], [1], vocab_size=512)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text(train_bpe(270, ["other words here"] * 9).blob)
    with pytest.raises(DataError, match="another tokenizer than the model's"):
        check_prepared([str(a)], [], vocab_size=512, hf_path=str(hf))
    (hf / "tokenizer.json").write_bytes(tok.read_bytes())
    check_prepared([str(a)], [], vocab_size=512, hf_path=str(hf))
    with pytest.raises(DataError, match="has no manifest.json"):
        tmp = tmp_path / "half"
        tmp.mkdir()
        check_prepared([str(tmp)], [], vocab_size=512)
    # a shard changed by one byte, then truncated
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    blob = bytearray((bad / "shard-00001.bin").read_bytes())
    blob[5] ^= 1
    (bad / "shard-00001.bin").write_bytes(bytes(blob))
    with pytest.raises(DataError, match="shard-00001.bin does not match its checksum"):
        check_prepared([str(bad)], [], vocab_size=512)
    (bad / "shard-00001.bin").write_bytes(bytes(blob[:-2]))
    with pytest.raises(DataError, match="truncated or damaged"):
        TokenData.load(bad, seq_len=16, val_fraction=0.05, seed=0)


@pytest.mark.dist
def test_training_on_a_blend_resumes_onto_the_same_windows(two, tmp_path):
    """4 steps on a 3:1 blend of two prepared folders, then steps 2 and 3 again, resumed from its
    step-2 checkpoint: the same losses step by step (the same windows, the same updates)."""
    from tests.conftest import run_train

    a, b, _ = two
    blend = ["--data.prepared", f"{a};{b}", "--data.weights", "3;1", "--model.vocab_size", "512",
             "--train.steps", "4", "--balance.when", "never", "--model.seq_len", "16"]
    whole = tmp_path / "whole"
    run_train(whole, *blend, "--checkpoint.every", "2")
    ckpt = min((p for p in whole.iterdir() if p.name.startswith("checkpoint")), key=lambda p: p.name)
    run_train(tmp_path / "resumed", *blend, "--checkpoint.resume", str(ckpt))

    def losses(out: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    assert losses(tmp_path / "resumed") == {s: v for s, v in losses(whole).items() if s >= 2}
