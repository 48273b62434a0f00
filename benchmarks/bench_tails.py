"""Stream tails: what an epoch over canonical streams leaves out, before and after issue 59.

On ``bench_scale.py``'s synthetic length index (lognormal lengths, bucket-pure shards of at most
``--rows-per-shard`` rows), for each size N, mode (pad, pack best_fit, pack concat) and world
size W (streams C = W), every block of every stream is planned once (``plan_block``, as a
reader plans it) and each batch's segments and tokens are kept. From the same batches:

- ``before``: the rule up to issue 59: every stream cut to the shortest stream's batch count
  (``tail="drop"``), then ``split_epoch`` drops the last ``(C x shortest) mod W`` batches;
- ``after``: today's reader (``StreamPlan``): a shorter stream cuts some of its batches in
  two until it is as long as the longest, every batch is in the plan, then ``split_epoch``
  drops the last ``total mod W`` global batches;
- ``global``: one plan of the whole epoch (``plan_epoch``, up to ``--global-max`` sequences:
  past it the plan needs several GiB), dropping ``count mod W``.

Reported per row: batches of the epoch (and how many are halves of a cut batch), the batches,
segments (sequences; concat: pieces) and tokens left out, as counts and shares, the bound
``max(W - 1 batches, 0.1 %)`` and whether ``after`` keeps it, and the epoch's batch count over
the global plan's, with and without the cut batches (without: padding, blocks planned apart).
Up to ``--share-max-world`` and ``--share-max-sequences``, for ranks 0, W/2 and W-1: the bytes
of the distinct shards a rank's epoch reads over its share, and its batches from streams it does
not own (another rank's shards), before (the rounds) and after. Both rules read one set of block
plans, so they are compared on the same batches.

    PYTHONPATH=. python benchmarks/bench_tails.py                       # 200k, 2M, 20M
    PYTHONPATH=. python benchmarks/bench_tails.py --sequences 200M --worlds 8,1024

Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np
from bench_scale import counts, human, load_index, make_index, sample_ranks, touched
from results import record_result

from shardcache.read.plan.epoch_plan import PlanOptions, plan_epoch, split_epoch
from shardcache.read.plan.streams import (
    ShardIndex,
    StreamLayout,
    StreamPlan,
    own_streams,
    plan_block,
    splittable,
)

MODES = {
    "pad": dict(mode="pad"),
    "best_fit": dict(mode="pack", packing="best_fit"),
    "concat": dict(mode="pack", packing="concat"),
}


def options_of(args: argparse.Namespace, mode: str) -> PlanOptions:
    extra: dict[str, Any] = dict(MODES[mode])
    if extra["mode"] == "pack":
        extra["seq_len"] = args.seq_len
    return PlanOptions(max_tokens=args.max_tokens, shuffle_block=args.block, **extra)


def stream_batches(
    layout: StreamLayout, options: PlanOptions, lengths: np.ndarray
) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[int, np.ndarray]]:
    """Per stream: each batch's segments and tokens, in the stream's order; block counts."""
    out = []
    blocks: dict[int, np.ndarray] = {}
    for s in range(layout.streams):
        segs, toks, sizes, cuttable = [], [], [], []
        for b in range(int(layout.blocks[s])):
            plan = plan_block(layout, options, s, b)
            n = len(plan)
            sizes.append(n)
            cuttable.append(splittable(plan))
            if not n:
                continue
            offsets = np.asarray(plan.batch_offsets)
            segs.append(np.diff(offsets))
            if plan.seg_lengths is not None:
                per = np.asarray(plan.seg_lengths, dtype=np.int64)
            else:
                per = np.asarray(lengths[np.asarray(plan.sample_ids)], dtype=np.int64)
            cum = np.r_[0, np.cumsum(per)]
            toks.append(cum[offsets[1:]] - cum[offsets[:-1]])
        out.append(
            (
                np.concatenate(segs) if segs else np.zeros(0, np.int64),
                np.concatenate(toks) if toks else np.zeros(0, np.int64),
            )
        )
        blocks[s] = np.array([sizes, cuttable], dtype=np.int64).reshape(2, -1)
    return out, blocks


def left_out_before(
    per_stream: list[tuple[np.ndarray, np.ndarray]], world: int
) -> tuple[int, int, int, int]:
    """The rule up to issue 59: (epoch batches, batches, segments, tokens) left out."""
    counts = np.array([len(s) for s, _ in per_stream], dtype=np.int64)
    streams = len(counts)
    shortest = int(counts.min())
    batches = segs = toks = 0
    for s, t in per_stream:  # each stream cut to the shortest
        batches += len(s) - shortest
        segs += int(s[shortest:].sum())
        toks += int(t[shortest:].sum())
    total = streams * shortest
    extra = total % world  # then the split: the last global batches of the rounds
    for j in range(total - extra, total):
        s, t = per_stream[j % streams]
        segs += int(s[j // streams])
        toks += int(t[j // streams])
    return total, batches + extra, segs, toks


def left_out_after(plan: StreamPlan, lengths: np.ndarray, world: int) -> tuple[int, int, int, int]:
    """Today's reader: (epoch batches, batches, segments, tokens) ``split_epoch`` leaves out."""
    dropped = split_epoch(len(plan), world, 0, "drop").dropped
    segs = toks = 0
    for j in dropped.tolist():
        ids, _, taken = plan.segments(j)
        segs += len(ids)
        toks += int(lengths[ids].sum()) if taken is None else int(taken.sum())
    return len(plan), len(dropped), segs, toks


def rank_share(
    plan: StreamPlan, total: int, shards: dict[str, np.ndarray], world: int
) -> dict[str, Any]:
    """Over the sampled ranks, reading the first ``total`` global batches of ``plan``: the
    bytes of the distinct shards a rank's epoch reads over its share (``cache / W``), and the
    share of its batches from streams it does not own (the max over ranks)."""
    share = int(shards["bytes"].sum()) / world
    rows = []
    for r in sample_ranks(world):
        batches = split_epoch(total, world, 0, "drop").for_rank(r)
        mine = set(own_streams(world, r, world))
        ids = [plan.batch(int(j)) for j in batches]
        _, got = touched(np.concatenate(ids or [np.zeros(0, np.int64)]), shards)
        foreign = sum(plan.stream_of(int(j))[0] not in mine for j in batches)
        rows.append((got / share, foreign / max(len(batches), 1)))
    return {
        "epoch_share_max": max(r[0] for r in rows),
        "epoch_share_mean": float(np.mean([r[0] for r in rows])),
        "foreign_batches_max": max(r[1] for r in rows),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    work = args.work or os.path.join(tempfile.gettempdir(), "shardcache-bench-scale")
    os.makedirs(work, exist_ok=True)
    for n in counts(args.sequences):
        lengths, shards = load_index(make_index(work, n, args.rows_per_shard))
        index = ShardIndex(shards["starts"], shards["tokens"], shards["buckets"], lengths)
        all_segments, all_tokens = n, int(shards["tokens"].sum())
        for mode in args.modes.split(","):
            options = options_of(args, mode)
            global_count = None
            if n <= args.global_max:
                buckets = np.repeat(shards["buckets"], np.diff(shards["starts"]))
                global_count = len(plan_epoch(np.asarray(lengths), buckets, options, 0, 0))
            for world in [int(w) for w in args.worlds.split(",")]:
                started = time.perf_counter()
                layout = StreamLayout(index, world, args.block, 0, 0, True)
                per_stream, blocks = stream_batches(layout, options, lengths)
                planned_s = time.perf_counter() - started
                row: dict[str, Any] = {
                    "sequences": n, "shards": index.num_shards, "mode": mode, "world": world,
                    "plan_s": round(planned_s, 2),
                }  # fmt: skip
                plan = StreamPlan(layout, options, blocks, keep=4)
                row["split_batches"] = plan.split_total
                # every global batch in whole rounds: no rank reads another's stream (W | C)
                row["foreign_batches"] = len(plan) - plan.full
                for rule in ("before", "after"):
                    if rule == "before":
                        total, batches, segs, toks = left_out_before(per_stream, world)
                    else:
                        total, batches, segs, toks = left_out_after(plan, lengths, world)
                    row[rule] = {
                        "epoch_batches": total,
                        "left_out_batches": batches,
                        "left_out_batch_share": batches / max(total, 1),
                        "left_out_segments": segs,
                        "left_out_segment_share": segs / all_segments,
                        "left_out_tokens": toks,
                        "left_out_token_share": toks / all_tokens,
                    }
                after = row["after"]
                bound = max(world - 1, int(0.001 * after["epoch_batches"]))
                row["bound_batches"] = bound
                row["after_within_bound"] = after["left_out_batches"] <= bound
                streams_total = len(plan)
                planned = int(sum(len(s) for s, _ in per_stream))
                if global_count is not None:
                    row["global_batches"] = global_count
                    row["global_left_out_batches"] = global_count % world
                    row["batches_over_global"] = streams_total / global_count
                    row["planned_over_global"] = planned / global_count
                if world <= args.share_max_world and n <= args.share_max_sequences:
                    shortest = min(len(seg) for seg, _ in per_stream)
                    # (before: the rounds of the planned batches; no stream cut a batch then)
                    before_plan = StreamPlan(layout, options, {
                        s: np.array([c[0], np.zeros_like(c[0])]) for s, c in blocks.items()
                    }, keep=4)  # fmt: skip
                    row["fetch"] = {
                        "before": rank_share(before_plan, shortest * world, shards, world),
                        "after": rank_share(plan, len(plan), shards, world),
                    }
                rows.append(row)
                b, a = row["before"], row["after"]
                over = row.get("batches_over_global")
                print(
                    f"{human(n):>5} {mode:8} W={world:<5} batches {streams_total:>9,}"
                    f" ({plan.split_total:,} cut in two, {len(plan) - plan.full} foreign)"
                    + (f" ({(over - 1) * 100:+.2f}% vs global)" if over else "")
                    + f" | left out: before {b['left_out_batches']:>6,} batches"
                    f" {b['left_out_segment_share']:7.3%} seqs"
                    f" {b['left_out_token_share']:7.3%} tokens"
                    f" | after {a['left_out_batches']:>5,} batches"
                    f" {a['left_out_segment_share']:7.3%} seqs"
                    f" {a['left_out_token_share']:7.3%} tokens"
                    f" (bound {bound:,}: {'ok' if row['after_within_bound'] else 'OVER'})"
                    f" plan {planned_s:.1f}s",
                    flush=True,
                )  # fmt: skip
                if "fetch" in row:
                    fb, fa = row["fetch"]["before"], row["fetch"]["after"]
                    print(
                        f"{'':>24} a rank's epoch reads (max over ranks {sample_ranks(world)}):"
                        f" before {fb['epoch_share_max']:.3f}x its share"
                        f" ({fb['foreign_batches_max']:.2%} batches of others' streams),"
                        f" after {fa['epoch_share_max']:.3f}x"
                        f" ({fa['foreign_batches_max']:.2%})",
                        flush=True,
                    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sequences", default="200k,2M,20M")
    p.add_argument("--worlds", default="3,8,64,1024")
    p.add_argument("--modes", default="pad,best_fit,concat")
    p.add_argument("--rows-per-shard", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16 * 4096)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--block", type=int, default=1 << 18)
    p.add_argument("--global-max", type=int, default=20_000_000)
    p.add_argument(
        "--share-max-world",
        type=int,
        default=64,
        help="the rank-share figures only up to this world size (they plan a rank)",
    )
    p.add_argument("--share-max-sequences", type=int, default=20_000_000)
    p.add_argument("--work", default=None, help="where the synthetic indexes are kept")
    args = p.parse_args()
    rows = run(args)
    record_result("bench_tails", {"rows": rows}, args)


if __name__ == "__main__":
    main()
