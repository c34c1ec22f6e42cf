"""Hash attention's FlexAttention BlockMask built directly from the tile matrices: the same
tensors as `BlockMask.from_kv_blocks` gives (its backward's query-side indices included), in a
number of operators that does not grow with the sequence, the heads or the buckets."""

from __future__ import annotations

import pytest
import torch

from dynmo.model import hashkernels
from dynmo.model.hashsort import tile_test
from dynmo.model.hostops import OpCounter

pytest.importorskip("torch.nn.attention.flex_attention")
from torch.nn.attention.flex_attention import BlockMask  # noqa: E402

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def sorted_heads(B: int, H: int, T: int, buckets: int, seed: int = 0):
    """(sorted bucket ids, their positions) for queries and keys, as `hash_sparse_attention` sorts."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randint(0, buckets, (B, H, T), generator=g) * T + torch.arange(T)
    s, order = key.sort(-1)
    return s // T, order, s // T, order


def via_from_kv_blocks(sbq, oq, sbk, ok, chunk: int) -> BlockMask:
    c = hashkernels.flex_tile(sbq.shape[-1], chunk)
    need, full = tile_test(sbq, oq, sbk, ok, c, full=True)

    def ordered(tiles):
        cols = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
        return tiles.sum(-1, dtype=torch.int32), cols.to(torch.int32)

    return BlockMask.from_kv_blocks(*ordered(need & ~full), *ordered(full), BLOCK_SIZE=c,
                                    seq_lengths=(sbq.shape[-1],) * 2)


@pytest.mark.parametrize("B,H,T,buckets,chunk", [(1, 2, 64, 2, 16), (2, 4, 256, 4, 16), (1, 3, 512, 16, 32)])
def test_direct_block_mask_equals_from_kv_blocks(B, H, T, buckets, chunk):
    heads = sorted_heads(B, H, T, buckets)
    got, ref = hashkernels.flex_block_mask(*heads, chunk), via_from_kv_blocks(*heads, chunk)
    assert got.BLOCK_SIZE == ref.BLOCK_SIZE and got.seq_lengths == ref.seq_lengths
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


def test_block_mask_operators_do_not_grow_with_sequence_heads_or_buckets():
    counts = set()
    for B, H, T, buckets in [(1, 2, 128, 2), (1, 2, 1024, 2), (1, 16, 128, 2), (2, 2, 128, 64), (2, 8, 2048, 32)]:
        with OpCounter(strict=True) as rec:
            hashkernels.flex_block_mask(*sorted_heads(B, H, T, buckets), 16)
        counts.add(rec.total)
    assert len(counts) == 1, counts
