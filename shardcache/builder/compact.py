"""Compaction at commit: a bucket's partial shards from many partitions joined into full ones.

Each bucket's shards are walked in partition order: a full shard is kept as it is,
consecutive partial ones are merged until they reach ``--shard-size``. The output is a pure
function of the records, whatever the number of threads merging independent groups at once.
Merged shards are written before the manifest and the shards they replace removed after it,
so a killed commit leaves every partition whole and a reader never sees a shard missing.
"""

from __future__ import annotations

import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shardcache.builder.build_plan import PartitionResult
from shardcache.store.layout import PARTS_DIR, merged_shard_name
from shardcache.store.shards import ShardInfo, merge_shards

#: Merged shards written at once at most: each thread holds about a member shard in memory,
#: and beyond a few the merge is bound by memory bandwidth and the disk.
MAX_MERGE_THREADS = 4

#: A slice of a partition's ``parts/<id>.lengths.npy``: the lengths of one shard's rows.
LengthSlice = tuple[str, int, int]


@dataclass
class Group:
    """Shards of one bucket, in row order, that become one shard of the cache.

    ``name`` is the merged shard's name; None keeps the one member as it is.
    """

    bucket: int
    members: list[ShardInfo]
    lengths: list[LengthSlice]
    name: str | None = None


@dataclass
class Compacted:
    """The cache's shards and length slices in sample-id order, after ``compact``.

    ``joined`` names the partitions' shards that merged ones replace (removed after the manifest).
    """

    shards: list[ShardInfo]
    lengths: list[LengthSlice]
    joined: list[str]

    def content_keys(self) -> list[LengthSlice]:
        """The slices of the partitions' ``parts/<id>.content_keys.npy`` of the same rows."""
        suffix = ".lengths.npy"
        return [(path[: -len(suffix)] + ".content_keys.npy", start, stop)
                for path, start, stop in self.lengths]  # fmt: skip


def plan_groups(shards: list[ShardInfo], target_tokens: int) -> list[list[int]]:
    """Index groups of one bucket's shards: a full one alone, consecutive smaller ones joined.

    A group of small shards closes once it reaches ``target_tokens``.
    """
    groups: list[list[int]] = []
    open_group: list[int] | None = None
    joined = 0
    for k, shard in enumerate(shards):
        if shard.tokens >= target_tokens:
            groups.append([k])
            continue
        if open_group is None:
            open_group, joined = [], 0
            groups.append(open_group)
        open_group.append(k)
        joined += shard.tokens
        if joined >= target_tokens:
            open_group = None
    return groups


def plan_compaction(
    out: str, results: list[PartitionResult], target_bytes: int, itemsize: int
) -> list[Group]:
    """The cache's shards as groups of partition shards, bucket by bucket; merged ones named."""
    by_bucket: dict[int, list[tuple[ShardInfo, LengthSlice]]] = defaultdict(list)
    for result in results:
        path = os.path.join(out, PARTS_DIR, f"{result.partition}.lengths.npy")
        row = 0
        for shard in result.shards:
            by_bucket[shard.bucket].append((shard, (path, row, row + shard.rows)))
            row += shard.rows
    target_tokens = -(-target_bytes // itemsize)
    groups = []
    for bucket in sorted(by_bucket):
        entries = by_bucket[bucket]
        merged = 0
        for indices in plan_groups([shard for shard, _ in entries], target_tokens):
            chosen = [entries[k] for k in indices]
            group = Group(bucket, [shard for shard, _ in chosen], [rows for _, rows in chosen])
            if len(indices) > 1:
                group.name = merged_shard_name(bucket, merged)
                merged += 1
            groups.append(group)
    return groups


def compact(
    out: str, groups: list[Group], compression: str, shard_size_bytes: int, threads: int = 1
) -> Compacted:
    """Write the merged shards of ``groups`` into the staged cache ``out``; kept ones stay put.

    ``threads`` merges run at once (each holds about one member shard in memory); the result is
    the same for any number. A damaged member raises the first failing group's
    ``CorruptShardError`` in group order, and merges not started by then are cancelled.
    """
    joins = [g for g in groups if g.name is not None]

    def merge(group: Group) -> ShardInfo:
        assert group.name is not None
        return merge_shards(out, group.members, group.name, compression, shard_size_bytes)

    if threads <= 1 or len(joins) <= 1:
        merged = [merge(g) for g in joins]
    else:
        pool = ThreadPoolExecutor(min(threads, len(joins)), thread_name_prefix="compact")
        try:
            merged = list(pool.map(merge, joins))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    by_name = {m.name: m for m in merged}
    compacted = Compacted([], [], [])
    for group in groups:
        if group.name is None:
            compacted.shards.extend(group.members)
        else:
            compacted.shards.append(by_name[group.name])
            compacted.joined.extend(m.name for m in group.members)
        compacted.lengths.extend(group.lengths)
    return compacted
