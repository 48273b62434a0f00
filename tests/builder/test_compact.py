"""Compaction at commit (shardcache/builder/compact.py): a bucket's partial shards from many
partitions joined into full ones, the rest kept; the content, provenance and masks unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import pyarrow as pa
import pytest

from conftest import CHATML_TEMPLATE, cache_data_files, make_conversations, write_records
from shardcache import CorruptShardError, open_cache
from shardcache.builder.commit import commit_output
from shardcache.builder.compact import plan_groups
from shardcache.builder.engines import EngineOptions, Share
from shardcache.builder.run import build
from shardcache.config import build_options_from_mapping
from shardcache.store.shards import ShardInfo

SHARD = 4096  # bytes of tokens (uint16 here: 2048 tokens)


def _info(tokens: int, k: int) -> ShardInfo:
    return ShardInfo(f"p{k:05d}-b00-00000.arrow", 0, f"p{k:05d}", "f", 1, tokens, 1, "0" * 64)


@pytest.mark.parametrize("seed", range(20))
def test_groups_join_consecutive_partial_shards_until_the_target(seed):
    rng = random.Random(seed)
    target = 100
    tokens = [rng.choice([rng.randint(1, 99), rng.randint(100, 250)]) for _ in range(30)]
    groups = plan_groups([_info(t, k) for k, t in enumerate(tokens)], target)
    assert sorted(k for g in groups for k in g) == list(range(len(tokens)))
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # in order of first rows
    open_groups = 0
    for group in groups:
        if len(group) == 1 and tokens[group[0]] >= target:
            continue  # a full shard, kept alone
        assert all(tokens[k] < target for k in group), "a full shard was joined"
        assert group == sorted(group)
        assert sum(tokens[k] for k in group[:-1]) < target  # closed once it reached the target
        open_groups += sum(tokens[k] for k in group) < target
    assert open_groups <= 1  # one partial shard at most: the last one opened
    # every partial shard after a group closed opens the next one: nothing could have joined
    partial = [k for k in range(len(tokens)) if tokens[k] < target]
    assert len(groups) - sum(1 for t in tokens if t >= target) <= max(1, len(partial))


@pytest.fixture()
def many_files(tmp_path):
    """Eight small input files (eight partitions), so every bucket has partial shards."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = {}
    for f in range(8):
        records = [{"text": t} for t in _texts(120 + 10 * f, seed=f)]
        write_records(str(folder / f"f{f}.jsonl"), records, "jsonl")
        texts.update({(f"f{f}.jsonl", i): r["text"] for i, r in enumerate(records)})
    return str(folder), texts


def _texts(n: int, seed: int) -> list[str]:
    from conftest import make_texts

    return make_texts(n, seed=seed, max_words=60)


def _build(inputs: str, tokenizer: str, out: str, **extra) -> str:
    values = {"input": inputs, "tokenizer": tokenizer, "output": out, "workers": 1,
              "shard_size": SHARD, "buckets": "16,64", **extra}  # fmt: skip
    build(build_options_from_mapping(values))
    return out


def _record(cache: str, partition: str) -> dict:
    with open(os.path.join(cache, "parts", f"{partition}.json"), encoding="utf-8") as f:
        return json.load(f)


def _by_record(path: str) -> dict[tuple[str, int, int], tuple[list[int], list[bool] | None]]:
    cache = open_cache(path)
    out = {}
    for seq in cache.iter_sequences():
        key = (seq.provenance.source, seq.provenance.record, seq.provenance.piece)
        assert key not in out, f"{key} stored twice"
        out[key] = (seq.ids.tolist(), None if seq.mask is None else seq.mask.tolist())
    return out


def _separately(folder: str, tokenizer: str, tmp_path, **extra) -> dict:
    """Every input file built on its own (one partition: nothing to join)."""
    want = {}
    for name in sorted(os.listdir(folder)):
        alone = tmp_path / f"alone-{name}"
        alone.mkdir()
        os.link(os.path.join(folder, name), alone / name)
        path = _build(str(alone), tokenizer, str(tmp_path / f"cache-{name}"), **extra)
        assert all("sources" not in s for s in open_cache(path).shards)
        want.update(_by_record(path))
    return want


def test_a_many_file_build_keeps_one_partial_shard_per_bucket_and_every_document(
    many_files, tokenizer_dir, tmp_path
):
    folder, texts = many_files
    path = _build(folder, tokenizer_dir, str(tmp_path / "cache"))
    cache = open_cache(path)
    manifest = cache.manifest
    partition_shards = [
        s for k in range(manifest["partitions"]) for s in _record(path, f"p{k:05d}")["shards"]
    ]
    assert len(manifest["shards"]) < len(partition_shards)
    merged = [s for s in manifest["shards"] if "sources" in s]
    assert merged and all(s["name"].startswith("merged-") for s in merged)
    # written as one writer would: every record batch but the last holds the batch bytes
    # (here the shard size, 4 KiB), not the members' short last batches one after another
    counts = []
    for shard in merged:
        with pa.ipc.open_file(os.path.join(path, "shards", shard["name"])) as f:
            batches = [len(f.get_batch(b).column(0).values) for b in range(f.num_record_batches)]
        assert all(tokens * 2 >= SHARD for tokens in batches[:-1]), batches
        counts.append(len(batches))
    assert max(counts) >= 2
    # per bucket at most one shard under the target, and buckets in order (sample ids)
    buckets = [s["bucket"] for s in manifest["shards"]]
    assert buckets == sorted(buckets)
    for b in set(buckets):
        small = [s for s in manifest["shards"] if s["bucket"] == b and s["tokens"] * 2 < SHARD]
        assert len(small) <= 1, (b, small)
    # full shards of a partition are kept under their name, not rewritten
    full = {s["name"]: s["sha256"] for s in partition_shards if s["tokens"] * 2 >= SHARD}
    kept = {s["name"]: s["sha256"] for s in manifest["shards"] if "sources" not in s}
    assert full and set(full) <= set(kept) and all(kept[n] == full[n] for n in full)
    # the folder holds what the manifest lists, nothing the merged shards replaced
    assert sorted(os.listdir(os.path.join(path, "shards"))) == sorted(
        s["name"] for s in manifest["shards"]
    )
    # every document once, with its own ids and provenance, whichever shard holds it
    got = _by_record(path)
    assert {(src, rec) for src, rec, _ in got} == set(texts)
    assert got == _separately(folder, tokenizer_dir, tmp_path)
    # lookup by sample id agrees with the sequence order; the length index with the shards
    lengths = np.load(os.path.join(path, "index", "lengths.npy"))
    for seq in cache.iter_sequences():
        assert cache.lookup(seq.sample_id) == seq.provenance
        assert lengths[seq.sample_id] == len(seq.ids)
    assert len(lengths) == sum(s["rows"] for s in manifest["shards"])


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_every_recorded_digest_is_the_sha256_of_the_file_on_disk(
    many_files, tokenizer_dir, tmp_path, compression
):
    """Shards are hashed as they are written (partition shards and merged ones, several
    merges at once): every size and sha256 the manifest and the partitions' records list is
    that of the bytes on disk."""
    folder, _ = many_files
    path = _build(folder, tokenizer_dir, str(tmp_path / "cache"), workers=3,
                  compression=compression)  # fmt: skip
    manifest = open_cache(path).manifest
    merged = [s for s in manifest["shards"] if "sources" in s]
    assert len(merged) >= 2 and len({s["bucket"] for s in manifest["shards"]}) >= 2
    for entry in manifest["shards"]:
        file = os.path.join(path, "shards", entry["name"])
        assert (os.path.getsize(file), _file_sha256(file)) == (entry["bytes"], entry["sha256"])
    # the partitions' own shards: the kept ones are still on disk, the joined ones were
    # checked against their records when merged (a mismatch fails the build)
    kept = 0
    for k in range(manifest["partitions"]):
        for entry in _record(path, f"p{k:05d}")["shards"]:
            file = os.path.join(path, "shards", entry["name"])
            if os.path.exists(file):
                kept += 1
                assert _file_sha256(file) == entry["sha256"]
    assert kept
    lengths = os.path.join(path, "index", "lengths.npy")
    assert _file_sha256(lengths) == manifest["index"]["lengths"]["sha256"]
    # merged one at a time, the same bytes
    alone = _build(folder, tokenizer_dir, str(tmp_path / "alone"), workers=1,
                   compression=compression)  # fmt: skip
    assert cache_data_files(alone) == cache_data_files(path)


def test_compressed_and_chat_shards_merge_with_their_masks(tokenizer_dir, tmp_path):
    folder = tmp_path / "chat"
    folder.mkdir()
    for f in range(4):
        records = [{"messages": m} for m in make_conversations(30, seed=10 + f)]
        write_records(str(folder / f"c{f}.jsonl"), records, "jsonl")
    template = tmp_path / "template.jinja"
    template.write_text(CHATML_TEMPLATE)
    from conftest import _chat_tokenizer

    chat_tok = _chat_tokenizer(str(tmp_path / "chat-tok"), CHATML_TEMPLATE, False)
    extra = {"chat": True, "compression": "zstd"}
    path = _build(str(folder), chat_tok, str(tmp_path / "cache"), **extra)
    assert any("sources" in s for s in open_cache(path).shards)
    got = _by_record(path)
    assert got == _separately(str(folder), chat_tok, tmp_path, **extra)
    assert all(mask is not None and not all(mask) for _, mask in got.values())


@pytest.mark.parametrize("workers", [1, 3])
def test_a_damaged_partial_shard_is_refused_at_commit_not_merged(
    many_files, tokenizer_dir, tmp_path, workers
):
    """A job array's shares wrote the partitions; a byte of one partial shard flipped before
    `shardcache commit`: the merge refuses it (naming it) instead of hashing the damage into
    a new shard, and nothing is committed (``workers`` > 1: merges run in threads)."""
    folder, _ = many_files
    out = str(tmp_path / "array")
    values = {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": workers,
              "shard_size": SHARD, "buckets": "16,64"}  # fmt: skip
    for i in range(2):
        build(build_options_from_mapping(values), EngineOptions(share=Share(i, 2)))
    record = _record(out, "p00003")
    victim = next(s for s in record["shards"] if s["tokens"] * 2 < SHARD and s["rows"] > 2)
    path = os.path.join(out, "shards", victim["name"])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptShardError, match=victim["name"]):
        commit_output(out)
    assert not os.path.exists(os.path.join(out, "manifest.json"))


def _file_limit(n: int):
    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return limit


def test_a_commit_joining_more_shards_than_the_file_limit_succeeds(tmp_path, tokenizer_dir):
    """1,100 one-record files under a 1,024-descriptor limit: the commit joins 1,100 partial
    shards of one bucket into one, which must not hold every member open at once (a 1 KiB
    partition size keeps each file of over 64 bytes a partition of its own)."""
    import subprocess
    import sys

    folder = tmp_path / "many"
    folder.mkdir()
    for k in range(1100):
        text = f"doc {k} lazy fox " + "the quick brown fox " * 4
        (folder / f"f{k:04d}.jsonl").write_text(json.dumps({"text": text}) + "\n")
    out = str(tmp_path / "out")
    script = (
        "from shardcache.builder.run import build_cache\n"
        "from shardcache.config import build_options_from_mapping\n"
        f"build_cache(build_options_from_mapping({{'input': {str(folder)!r}, "
        f"'tokenizer': {tokenizer_dir!r}, 'output': {out!r}, 'workers': 1, "
        "'partition_size': '1KiB'}))\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": repo}, preexec_fn=_file_limit(1024),
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    cache = open_cache(out)
    assert cache.manifest["partitions"] == 1100
    assert cache.num_sequences == 1100 and len(cache.manifest["shards"]) == 1
