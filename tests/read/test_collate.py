"""Direct tests of the pure-numpy batch collation (shardcache.read.collate)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache.read.collate import IGNORE_INDEX, pack_batch, pad_batch

PAD = 0


def _arr(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def test_pad_batch_masks_padding_and_keeps_tokens():
    rows = [_arr(5, 6, 7), _arr(8)]
    out = pad_batch(rows, _arr(10, 11), PAD)
    assert list(out) == ["input_ids", "attention_mask", "labels", "sample_ids"]
    assert all(v.dtype == np.int64 for v in out.values())
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, PAD, PAD]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert out["sample_ids"].tolist() == [10, 11]


def test_pad_batch_width_and_pad_id():
    out = pad_batch([_arr(1, 2, 3)], _arr(0), pad_id=9, width=8)
    assert out["input_ids"].tolist() == [[1, 2, 3, 9, 9, 9, 9, 9]]
    assert out["attention_mask"].sum() == 3
    assert (out["labels"][0, 3:] == IGNORE_INDEX).all()


def test_pad_batch_loss_masks_keep_only_trainable_labels():
    rows = [_arr(5, 6, 7), _arr(8, 9)]
    masks = [np.array([False, True, True]), np.array([True, False])]
    out = pad_batch(rows, _arr(0, 1), PAD, loss_masks=masks)
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_pack_batch_labels_positions_and_cu_seqlens():
    # two rows of 5 slots: row 0 = sample 3 (3 tokens) + sample 4 (2 tokens), row 1 = sample 5
    # (2 tokens) + 3 padding slots
    pieces = [_arr(1, 2, 3), _arr(4, 5), _arr(6, 7)]
    ids, starts = _arr(3, 4, 5), _arr(0, 0, 0)
    out = pack_batch(pieces, ids, starts, None, _arr(0, 2, 3), seq_len=5, pad_id=PAD)
    assert list(out) == [
        "input_ids",
        "labels",
        "position_ids",
        "cu_seqlens",
        "max_seqlen",
        "sample_ids",
        "sample_offsets",
    ]
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, PAD, PAD, PAD]]
    # -100 on each segment's first token and on padding
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 5], [-100, 7, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert out["cu_seqlens"].dtype == np.int32
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 7, 10]
    assert out["max_seqlen"] == 3 and isinstance(out["max_seqlen"], int)
    assert out["sample_ids"].tolist() == [3, 4, 5, -1]
    assert out["sample_offsets"].tolist() == [0, 0, 0, -1]
    for key in ("input_ids", "labels", "position_ids", "sample_ids", "sample_offsets"):
        assert out[key].dtype == np.int64


def test_pack_batch_cuts_pieces_of_sequences():
    # concat packing: sample 7 continues from offset 2 of its sequence, sample 8 is cut at 2
    pieces = [_arr(10, 11, 12, 13), _arr(20, 21, 22)]
    out = pack_batch(pieces, _arr(7, 8), _arr(2, 0), _arr(2, 2), _arr(0, 2), 4, PAD)
    assert out["input_ids"].tolist() == [[12, 13, 20, 21]]
    assert out["labels"].tolist() == [[-100, 13, -100, 21]]
    assert out["sample_offsets"].tolist() == [2, 0]
    assert out["cu_seqlens"].tolist() == [0, 2, 4]


def test_pack_batch_loss_masks():
    pieces = [_arr(1, 2, 3), _arr(4, 5)]
    masks = [np.array([False, True, False]), np.array([True, True])]
    out = pack_batch(pieces, _arr(0, 1), _arr(0, 0), None, _arr(0, 2), 6, PAD, masks)
    assert out["labels"].tolist() == [[-100, 2, -100, -100, 5, -100]]


def _pack_reference(rows: list[list[list[int]]], seq_len: int) -> tuple[list, list, list]:
    """Row by row, token by token: input ids, labels and positions of a packed batch."""
    ids, labels, positions = [], [], []
    for row in rows:
        r_ids, r_labels, r_pos = [], [], []
        for seg in row:
            r_ids += seg
            r_labels += [-100, *seg[1:]]
            r_pos += list(range(len(seg)))
        pad = seq_len - len(r_ids)
        r_ids += [PAD] * pad
        r_labels += [-100] * pad
        r_pos += list(range(pad))
        ids.append(r_ids)
        labels.append(r_labels)
        positions.append(r_pos)
    return ids, labels, positions


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 12).flatmap(
        lambda seq_len: st.tuples(
            st.just(seq_len),
            st.lists(
                st.lists(st.integers(1, seq_len), min_size=1, max_size=4).filter(
                    lambda sizes: sum(sizes) <= seq_len
                ),
                min_size=1,
                max_size=4,
            ),
        )
    )
)
def test_pack_batch_matches_a_token_by_token_reference(case):
    seq_len, row_sizes = case
    counter = iter(range(1, 10_000))
    rows = [[[next(counter) for _ in range(n)] for n in sizes] for sizes in row_sizes]
    pieces = [np.asarray(seg, dtype=np.int64) for row in rows for seg in row]
    bounds = np.r_[0, np.cumsum([len(row) for row in rows])]
    ids = np.arange(len(pieces), dtype=np.int64)
    out = pack_batch(pieces, ids, np.zeros_like(ids), None, bounds, seq_len, PAD)
    want_ids, want_labels, want_pos = _pack_reference(rows, seq_len)
    assert out["input_ids"].tolist() == want_ids
    assert out["labels"].tolist() == want_labels
    assert out["position_ids"].tolist() == want_pos
    assert int(out["cu_seqlens"][-1]) == len(rows) * seq_len
    assert out["sample_ids"][out["sample_ids"] >= 0].tolist() == ids.tolist()


def test_collate_does_not_import_torch():
    code = "import sys, shardcache.read.collate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
