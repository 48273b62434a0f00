"""Compaction at commit: a bucket's partial shards from many partitions joined into full ones.

Every partition writes its own shards, bucket by bucket, and closes each bucket's last shard
where the partition ends. So a build of N input files leaves up to N partial shards in every
bucket, where one writer would have made a few full ones; each shard costs a reader an open
(a stat, a map, its offsets checked against the length index) and its first page faults.

:func:`compact` walks each bucket's shards in partition order. A full shard (its tokens reach
the target ``--shard-size``) is kept as it is, not rewritten. Consecutive partial shards are
joined (:func:`~shardcache.store.shards.merge_shards`: their rows rewritten in record batches
cut as one writer cuts them) until the joined tokens reach the target; a partial shard left
alone is kept too. The cache lists its shards bucket by bucket, each bucket's in the order of
their first rows, so sample ids run bucket by bucket.

What it writes is a pure function of the partitions' records, so a build stays byte-identical
for any number of processes and after a kill and resume. The merged shards are written before
the manifest and the shards they join are removed after it: a commit killed before the
manifest leaves every partition whole (the resumed build removes the merged files, which no
completed partition lists, and merges again), and a reader never sees a shard missing.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from shardcache.builder.build_plan import PartitionResult
from shardcache.store.layout import PARTS_DIR, merged_shard_name
from shardcache.store.shards import ShardInfo, merge_shards

#: A slice of a partition's ``parts/<id>.lengths.npy``: the lengths of one shard's rows.
LengthSlice = tuple[str, int, int]


@dataclass
class Group:
    """Shards of one bucket that become one shard of the cache: one kept as it is, or
    several joined into the merged shard ``name``."""

    bucket: int
    members: list[ShardInfo]
    #: the slices of the partitions' length files that hold the members' lengths
    lengths: list[LengthSlice]
    name: str | None = None


@dataclass
class Compacted:
    """The cache's shards after :func:`compact`, in manifest (sample-id) order."""

    shards: list[ShardInfo]
    #: the slices of the partitions' length files, in sample-id order
    lengths: list[LengthSlice]
    #: the partitions' shards that merged shards replace (removed after the manifest)
    joined: list[str]


def plan_groups(shards: list[ShardInfo], target_tokens: int) -> list[list[int]]:
    """Indices into ``shards`` (one bucket's, in partition order), grouped: a shard of at
    least ``target_tokens`` tokens alone, consecutive smaller ones together until their sum
    reaches it. Groups are in the order of their first member."""
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
    """The cache's shards as groups of the partitions' shards (``results`` in partition
    order; ``out``: the folder whose ``parts/`` holds their length files), bucket by bucket;
    ``target_bytes`` of tokens (``itemsize`` bytes each) make a full shard."""
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


def compact(out: str, groups: list[Group], compression: str, shard_size_bytes: int) -> Compacted:
    """Write the merged shards of ``groups`` into the cache folder ``out`` (whose shards
    folder holds their members; ``compression`` and ``shard_size_bytes`` the build's); the kept
    shards are not touched."""
    compacted = Compacted([], [], [])
    for group in groups:
        if group.name is None:
            compacted.shards.extend(group.members)
        else:
            merged = merge_shards(out, group.members, group.name, compression, shard_size_bytes)
            compacted.shards.append(merged)
            compacted.joined.extend(m.name for m in group.members)
        compacted.lengths.extend(group.lengths)
    return compacted
