"""Direct tests of the pure-numpy batch collation (shardcache.read.collate.layout), and property
tests that the vectorised collation equals the per-sequence reference it replaced (kept here
as ``_reference_pad`` / ``_reference_pack``) for random plans of every mode, with and without
chat loss masks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache.read.collate.layout import IGNORE_INDEX, pack_batch, packed_layout, pad_batch
from shardcache.read.plan.epoch_plan import PlanOptions, plan_epoch

PAD = 0


def _flat(parts) -> np.ndarray:
    return np.concatenate(parts) if len(parts) else np.zeros(0, dtype=np.int64)


def _pad(rows, sample_ids, pad_id, width=None, loss_masks=None):
    """pad_batch called with one array per row (as the tests below write them)."""
    lengths = np.asarray([len(r) for r in rows], dtype=np.int64)
    masks = None if loss_masks is None else _flat(loss_masks)
    return pad_batch(_flat(rows), lengths, sample_ids, pad_id, width, masks)


def _pack(pieces, sample_ids, starts, lengths, row_bounds, seq_len, pad_id, loss_masks=None):
    """pack_batch called with whole sequences + (starts, lengths), like the old signature."""
    if lengths is None:
        lengths = np.asarray([len(p) for p in pieces], dtype=np.int64)
    segs = [p[s : s + n] for p, s, n in zip(pieces, starts, lengths)]
    masks = None
    if loss_masks is not None:
        masks = _flat([m[s : s + n] for m, s, n in zip(loss_masks, starts, lengths)]).astype(bool)
    seg_lengths = np.asarray([len(x) for x in segs], dtype=np.int64)
    return pack_batch(
        _flat(segs), seg_lengths, sample_ids, starts, row_bounds, seq_len, pad_id, masks
    )


def _arr(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def test_pad_batch_masks_padding_and_keeps_tokens():
    rows = [_arr(5, 6, 7), _arr(8)]
    out = _pad(rows, _arr(10, 11), PAD)
    assert list(out) == ["input_ids", "attention_mask", "labels", "sample_ids", "num_tokens"]
    assert all(v.dtype == np.int64 for v in out.values() if not isinstance(v, int))
    assert out["num_tokens"] == 4
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, PAD, PAD]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert out["sample_ids"].tolist() == [10, 11]


def test_pad_batch_width_and_pad_id():
    out = _pad([_arr(1, 2, 3)], _arr(0), pad_id=9, width=8)
    assert out["input_ids"].tolist() == [[1, 2, 3, 9, 9, 9, 9, 9]]
    assert out["attention_mask"].sum() == 3
    assert (out["labels"][0, 3:] == IGNORE_INDEX).all()


def test_pad_batch_loss_masks_keep_only_trainable_labels():
    rows = [_arr(5, 6, 7), _arr(8, 9)]
    masks = [np.array([False, True, True]), np.array([True, False])]
    out = _pad(rows, _arr(0, 1), PAD, loss_masks=masks)
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_pack_batch_labels_positions_and_cu_seqlens():
    # two rows of 5 slots: row 0 = sample 3 (3 tokens) + sample 4 (2 tokens), row 1 = sample 5
    # (2 tokens) + 3 padding slots
    pieces = [_arr(1, 2, 3), _arr(4, 5), _arr(6, 7)]
    ids, starts = _arr(3, 4, 5), _arr(0, 0, 0)
    out = _pack(pieces, ids, starts, None, _arr(0, 2, 3), seq_len=5, pad_id=PAD)
    assert list(out) == [
        "input_ids",
        "labels",
        "position_ids",
        "cu_seqlens",
        "max_seqlen",
        "sample_ids",
        "sample_offsets",
        "num_tokens",
    ]
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, PAD, PAD, PAD]]
    assert out["num_tokens"] == 7 and isinstance(out["num_tokens"], int)  # padding not counted
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
    out = _pack(pieces, _arr(7, 8), _arr(2, 0), _arr(2, 2), _arr(0, 2), 4, PAD)
    assert out["input_ids"].tolist() == [[12, 13, 20, 21]]
    assert out["labels"].tolist() == [[-100, 13, -100, 21]]
    assert out["sample_offsets"].tolist() == [2, 0]
    assert out["cu_seqlens"].tolist() == [0, 2, 4]


def test_pack_batch_loss_masks():
    pieces = [_arr(1, 2, 3), _arr(4, 5)]
    masks = [np.array([False, True, False]), np.array([True, True])]
    out = _pack(pieces, _arr(0, 1), _arr(0, 0), None, _arr(0, 2), 6, PAD, masks)
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
    out = _pack(pieces, ids, np.zeros_like(ids), None, bounds, seq_len, PAD)
    want_ids, want_labels, want_pos = _pack_reference(rows, seq_len)
    assert out["input_ids"].tolist() == want_ids
    assert out["labels"].tolist() == want_labels
    assert out["position_ids"].tolist() == want_pos
    assert int(out["cu_seqlens"][-1]) == len(rows) * seq_len
    assert out["sample_ids"][out["sample_ids"] >= 0].tolist() == ids.tolist()


def test_collate_does_not_import_torch():
    code = "import sys, shardcache.read.collate.layout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the vectorised collation equals the per-sequence reference it replaced -----------------


def _reference_pad(rows, sample_ids, pad_id, width, loss_masks=None):
    """The previous pad_batch: one array per row."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    mask = np.arange(width)[None, :] < lengths[:, None]
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
    labels = np.where(mask, input_ids, IGNORE_INDEX)
    if loss_masks is not None:
        for i, m in enumerate(loss_masks):
            labels[i, : len(m)][~m] = IGNORE_INDEX
    return {
        "input_ids": input_ids,
        "attention_mask": mask.astype(np.int64),
        "labels": labels,
        "sample_ids": np.asarray(sample_ids, dtype=np.int64),
        "num_tokens": int(sum(len(row) for row in rows)),
    }


def _reference_pack(pieces, sample_ids, starts, lengths, row_bounds, seq_len, pad_id, masks):
    """The previous pack_batch: a Python loop per segment."""
    if lengths is not None:
        cuts = list(zip(starts.tolist(), lengths.tolist()))
        pieces = [p[s : s + n] for p, (s, n) in zip(pieces, cuts)]
        if masks is not None:
            masks = [m[s : s + n] for m, (s, n) in zip(masks, cuts)]
    bounds = np.asarray(row_bounds).tolist()
    parts, loss_parts, seg_len, seg_sample, seg_offset = [], [], [], [], []
    for r in range(len(bounds) - 1):
        used = 0
        for k in range(bounds[r], bounds[r + 1]):
            parts.append(pieces[k])
            if masks is not None:
                loss_parts.append(masks[k])
            used += len(pieces[k])
            seg_len.append(len(pieces[k]))
            seg_sample.append(int(sample_ids[k]))
            seg_offset.append(int(starts[k]))
        if used < seq_len:
            parts.append(np.full(seq_len - used, pad_id, dtype=np.int64))
            loss_parts.append(np.zeros(seq_len - used, dtype=bool))
            seg_len.append(seq_len - used)
            seg_sample.append(-1)
            seg_offset.append(-1)
    flat = np.concatenate(parts).astype(np.int64)
    seg_lengths = np.asarray(seg_len, dtype=np.int64)
    cu = np.r_[0, np.cumsum(seg_lengths)].astype(np.int64)
    sample = np.asarray(seg_sample, dtype=np.int64)
    positions = np.arange(len(flat), dtype=np.int64) - np.repeat(cu[:-1], seg_lengths)
    labels = flat.copy()
    labels[cu[:-1]] = IGNORE_INDEX
    for k in np.flatnonzero(sample < 0).tolist():
        labels[cu[k] : cu[k + 1]] = IGNORE_INDEX
    if masks is not None:
        labels[~np.concatenate(loss_parts)] = IGNORE_INDEX
    shape = (len(bounds) - 1, seq_len)
    return {
        "input_ids": flat.reshape(shape),
        "labels": labels.reshape(shape),
        "position_ids": positions.reshape(shape),
        "cu_seqlens": cu.astype(np.int32),
        "max_seqlen": int(seg_lengths.max()),
        "sample_ids": sample,
        "sample_offsets": np.asarray(seg_offset, dtype=np.int64),
        "num_tokens": int(seg_lengths[sample >= 0].sum()),
    }


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype, key
            assert got[key].shape == value.shape, key
            assert np.array_equal(got[key], value), key
        else:
            assert got[key] == value and type(got[key]) is type(value), key


_corpus = st.lists(st.integers(1, 40), min_size=1, max_size=60).flatmap(
    lambda lengths: st.tuples(
        st.just(lengths),
        st.integers(0, 2**31 - 1),  # token ids / masks seed
        st.sampled_from(["pad", "best_fit", "concat"]),
        st.integers(0, 1000),  # plan seed
        st.booleans(),  # chat loss masks
        st.integers(1, 16),  # window size
        st.integers(1, 4),  # pad_to_multiple_of / rows per batch
    )
)


@settings(max_examples=150, deadline=None)
@given(_corpus)
def test_vectorised_collation_equals_the_reference_for_random_plans(case):
    lengths, data_seed, mode, seed, chat, window, k = case
    rng = np.random.default_rng(data_seed)
    seqs = [rng.integers(0, 60_000, n).astype(np.uint16) for n in lengths]
    masks = [rng.random(n) < 0.6 for n in lengths] if chat else None
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    buckets = (lengths_arr > 20).astype(np.int32)
    longest = int(lengths_arr.max())
    if mode == "pad":
        options = PlanOptions(
            max_tokens=longest * 3 + 4 * k, window_size=window, pad_to_multiple_of=k
        )
    else:
        seq_len = longest if mode == "best_fit" else max(1, longest // 2)
        options = PlanOptions(
            max_tokens=seq_len * k, mode="pack", seq_len=seq_len, packing=mode, window_size=window
        )
    plan = plan_epoch(lengths_arr, buckets, options, seed=seed)
    for index in range(len(plan)):
        ids, starts, taken = plan.segments(index)
        whole = [seqs[i].astype(np.int64) for i in ids]
        whole_masks = None if masks is None else [masks[i] for i in ids]
        taken_arr = lengths_arr[ids] - starts if taken is None else taken
        flat = _flat([w[s : s + n] for w, s, n in zip(whole, starts, taken_arr)])
        flat_mask = None
        if whole_masks is not None:
            flat_mask = _flat([m[s : s + n] for m, s, n in zip(whole_masks, starts, taken_arr)])
            flat_mask = flat_mask.astype(bool)
        # tokens arrive in the cache dtype (uint16 here), as Cache.gather delivers them
        flat = flat.astype(np.uint16)
        if mode == "pad":
            width = int(options.padded(int(taken_arr.max())))
            got = pad_batch(flat, taken_arr, ids, 7, width, flat_mask)
            want = _reference_pad(whole, ids, 7, width, whole_masks)
            # the same batch from tokens (and masks) already laid out in padded rows
            rows = np.full((len(ids), width), 7, dtype=np.int64)
            row_masks = np.zeros((len(ids), width), dtype=bool)
            for r, (w, n) in enumerate(zip(whole, taken_arr.tolist())):
                rows[r, :n] = w[:n]
                if whole_masks is not None:
                    row_masks[r, :n] = whole_masks[r][:n]
            laid = pad_batch(
                rows.reshape(-1), taken_arr, ids, 7, width,
                None if whole_masks is None else row_masks.reshape(-1), laid_out=True,
            )  # fmt: skip
            _assert_same(laid, want)
        else:
            seq_len = int(options.seq_len or 0)
            bounds = plan.row_bounds(index)
            got = pack_batch(flat, taken_arr, ids, starts, bounds, seq_len, 7, flat_mask)
            want = _reference_pack(whole, ids, starts, taken, bounds, seq_len, 7, whole_masks)
            # the same batch gathered straight into its rows (packed_layout)
            dst = packed_layout(taken_arr, bounds, seq_len)
            slots = np.full((len(bounds) - 1) * seq_len, 7, dtype=np.int64)
            slot_mask = np.zeros(len(slots), dtype=bool)
            for d, piece, n in zip(dst.tolist(), np.split(flat, np.cumsum(taken_arr)[:-1]),
                                   taken_arr.tolist()):  # fmt: skip
                slots[d : d + n] = piece
            if flat_mask is not None:
                for d, piece, n in zip(dst.tolist(),
                                       np.split(flat_mask, np.cumsum(taken_arr)[:-1]),
                                       taken_arr.tolist()):  # fmt: skip
                    slot_mask[d : d + n] = piece
            laid = pack_batch(slots, taken_arr, ids, starts, bounds, seq_len, 7,
                              None if flat_mask is None else slot_mask, laid_out=True)  # fmt: skip
            _assert_same(laid, want)
        _assert_same(got, want)
