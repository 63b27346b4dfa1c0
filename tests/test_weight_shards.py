"""llamarl.app.weights.shards: FSDP2's dim-0 chunks, and where each sender's bytes land on a generator."""

from __future__ import annotations

import pytest
import torch

from llamarl.app.weights.layout import Layout
from llamarl.app.weights.shards import Landing, Shards, check_tiling, chunk_rows, local_parts, meta_params


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 10])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_chunk_rows_are_torch_chunks_then_empty(rows, ranks):
    chunks = torch.arange(rows).chunk(ranks) if rows else ()
    for rank in range(ranks):
        start, stop = chunk_rows(rows, ranks, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == expected, (rows, ranks, rank)


def test_chunk_rows_by_hand():
    # 5 rows over 4 ranks: ceil(5/4) = 2 rows each, the third rank 1, the fourth none.
    assert [chunk_rows(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def full_params() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.arange(12.0).reshape(6, 2)),  # 3 ranks: rows 2, 2, 2
            ("b", torch.arange(5.0)),  # 3 ranks: 2, 2, 1
            ("c", torch.arange(4.0).reshape(1, 4))]  # 3 ranks: 1, 0, 0


def parts(rank: int, ranks: int) -> list[tuple[str, torch.Tensor]]:
    """What a rank of a dim-0-sharded trainer holds (plain tensors here, rows cut by hand)."""
    out = []
    for name, p in full_params():
        start, stop = chunk_rows(p.shape[0], ranks, rank)
        out.append((name, p[start:stop].clone()))
    return out


def test_landing_puts_each_rank_part_where_it_belongs():
    full = full_params()
    full_layout = Layout(full, bucket_bytes=1024)
    staging = torch.full((12 + 5 + 4,), -1.0)
    senders = []
    for rank in range(3):
        local = parts(rank, 3)
        # Starts by hand: a rows [2r, 2r+2) of 2 -> element 4r; b rows [2r, ..) -> 2r; c row 0 on rank 0.
        shards = Shards(rank=rank, ranks=3, full_shapes=((6, 2), (5,), (1, 4)),
                        starts=(4 * rank, 2 * rank, 0 if rank == 0 else 4))
        layout = Layout(local, bucket_bytes=1024)  # one bucket: a, b, c packed together
        (bucket,) = layout.runs[0].buckets
        sent = torch.cat([t.reshape(-1) for _, t in local])  # what lands in the rank's staging
        moves = Landing(layout, shards, full_layout).moves(layout.runs[0])
        # One copy per part: a rank's parts of a, b and c lie apart in the full weights.
        assert moves == {0: [(0, 0, 4), (4, 12, 2), (6, 17, 4)], 1: [(0, 4, 4), (4, 14, 2)],
                         2: [(0, 8, 4), (4, 16, 1)]}[rank]
        assert moves == Landing(layout, shards, full_layout).moves(bucket)
        for src, dst, n in moves:
            staging[dst:dst + n] = sent[src:src + n]
        senders.append((shards, layout))
    assert torch.equal(staging, torch.cat([p.reshape(-1) for _, p in full]))
    check_tiling(senders, full)
    with pytest.raises(ValueError, match="cover elements"):
        check_tiling(senders[:2], full)  # rank 2's rows missing


def test_one_rank_moves_in_one_copy_and_a_bucket_from_its_own_offset():
    full = full_params()
    full_layout = Layout(full, bucket_bytes=1024)
    local, shards = local_parts(full, rank=0, ranks=1)
    layout = Layout(local, bucket_bytes=1024)
    assert Landing(layout, shards, full_layout).moves(layout.runs[0]) == [(0, 0, 21)]  # the whole run
    # A rank with no part of a run: nothing to move.
    local, shards = local_parts(full, rank=1, ranks=2)
    assert Landing(Layout(local, 1024), shards, full_layout).moves(Layout(local, 1024).runs[0]) == []
    # Rank 1 of 3 with "a" alone in its bucket (alone_bytes 16): then b with c (empty on
    # this rank); a bucket's moves count from its own start.
    layout = Layout(parts(1, 3), bucket_bytes=1024, alone_bytes=16)
    shards = Shards(rank=1, ranks=3, full_shapes=((6, 2), (5,), (1, 4)), starts=(4, 2, 4))
    landing = Landing(layout, shards, full_layout)
    assert [landing.moves(b) for b in layout.runs[0].buckets] == [[(0, 4, 4)], [(0, 14, 2)]]
    # Plain tensors with several ranks: rank 0 sends them whole, the others nothing.
    local, shards = local_parts(full, rank=1, ranks=2)
    assert [t.numel() for _, t in local] == [0, 0, 0] and shards.starts == (12, 5, 4)


def test_meta_params_rebuild_the_same_layout():
    layout = Layout(full_params(), bucket_bytes=16, alone_bytes=8)
    rebuilt = Layout(meta_params(layout.entries), bucket_bytes=16, alone_bytes=8)
    assert rebuilt.fingerprint == layout.fingerprint and rebuilt.runs == layout.runs
    with pytest.raises(ValueError, match="bad layout entry"):
        meta_params([["x", [2], "os.system"]])
