"""What a token budget costs a cache before training: padding in pad mode, fill in pack mode.

Plans one epoch (pure numpy, no shard read) and counts the slots its batches hold against the
tokens in them; ``shardcache info --lengths`` prints it next to the length histogram.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardcache.read.plan.epoch_plan import PlanOptions, plan_epoch


def pad_cost(
    lengths: np.ndarray, buckets: np.ndarray, max_tokens: int, seed: int = 0
) -> dict[str, Any]:
    """Slots, tokens and padding per bucket of an epoch in pad mode (``bucket`` -> counts)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = np.asarray(buckets, dtype=np.int64)
    plan = plan_epoch(lengths, buckets, PlanOptions(max_tokens), seed)
    starts = plan.batch_offsets[:-1]
    if not len(starts):
        return {"batches": 0, "slots": 0, "tokens": 0, "padding": 0, "buckets": {}}
    planned = lengths[plan.sample_ids]
    width = np.maximum.reduceat(planned, starts)
    rows = np.diff(plan.batch_offsets)
    bucket = buckets[plan.sample_ids[starts]]  # a pad batch holds one bucket
    size = int(buckets.max()) + 1
    slots = np.bincount(bucket, weights=rows * width, minlength=size).astype(np.int64)
    tokens = np.bincount(buckets, weights=lengths, minlength=size).astype(np.int64)
    batches = np.bincount(bucket, minlength=size)
    per_bucket = {
        int(b): {
            "batches": int(batches[b]),
            "slots": int(slots[b]),
            "tokens": int(tokens[b]),
            "padding": int(slots[b] - tokens[b]),
        }
        for b in np.flatnonzero(batches).tolist()
    }
    total_slots, total_tokens = int(slots.sum()), int(tokens.sum())
    return {"batches": len(starts), "slots": total_slots, "tokens": total_tokens,
            "padding": total_slots - total_tokens, "buckets": per_bucket}  # fmt: skip


def pack_fill(
    lengths: np.ndarray, buckets: np.ndarray, max_tokens: int, seq_len: int, seed: int = 0
) -> dict[str, Any]:
    """Rows, slots and the share of them holding tokens in a best-fit pack-mode epoch."""
    lengths = np.asarray(lengths, dtype=np.int64)
    options = PlanOptions(max_tokens, mode="pack", seq_len=seq_len)
    plan = plan_epoch(lengths, np.asarray(buckets), options, seed)
    rows = len(plan.sample_ids) if plan.row_offsets is None else len(plan.row_offsets) - 1
    tokens = int(lengths.sum())
    slots = rows * seq_len
    return {"batches": len(plan), "rows": rows, "seq_len": seq_len, "slots": slots,
            "tokens": tokens, "fill": tokens / slots if slots else 0.0}  # fmt: skip
