"""Read-ahead against a real S3 API server (moto on 127.0.0.1): the batches equal a local
read, a tiny local shard cache never loses a shard about to be used, a flaky store still
yields every batch once, resume starts the read-ahead at the resumed position, and an early
stop leaves no thread or descriptor. Slow tier (``-m slow``)."""

from __future__ import annotations

import logging
import os
import re
import threading

import numpy as np
import pytest

from conftest import assert_batches_equal, make_texts, write_records
from shardcache import ShardDataset
from shardcache.read.fetch.shard_readahead import ReadAheadOptions, shards_of
from shardcache.store.cache import Cache

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

URL = "s3://corpus/caches/ra"


@pytest.fixture()
def local(build_cache, tokenizer_dir, tmp_path):
    """A cache of many small shards on local disk."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for f in range(3):
        texts = make_texts(300, seed=f, max_words=800)
        write_records(str(folder / f"part-{f}.jsonl"), [{"text": t} for t in texts], "jsonl")
    return build_cache(str(folder), tokenizer_dir, shard_size=4096, buckets="64,256")


@pytest.fixture()
def remote(s3, local):
    """``local`` uploaded to the S3 server; yields its URL."""
    for root, _, names in os.walk(local):
        for name in names:
            path = os.path.join(root, name)
            s3.upload_file(path, "corpus", f"caches/ra/{os.path.relpath(path, local)}")
    return URL


class Downloads:
    """Counts the shard downloads of this process (``shardcache.store.remote.download``);
    ``fail_every``: the first attempt of every n-th object fails (the store recovers)."""

    def __init__(self, monkeypatch, fail_every: int = 0):
        from shardcache.store import remote

        self.real = remote.download
        self.fail_every = fail_every
        self.calls: dict[str, int] = {}
        self.failed: list[str] = []
        self.lock = threading.Lock()
        monkeypatch.setattr(remote, "download", self)

    def __call__(self, fs, rpath, *args, **kwargs):
        with self.lock:
            first = rpath not in self.calls
            self.calls[rpath] = self.calls.get(rpath, 0) + 1
            fail = self.fail_every and first and len(self.calls) % self.fail_every == 0
            if fail:
                self.failed.append(rpath)
        if fail:
            raise ConnectionResetError(f"connection reset while reading {rpath}")
        return self.real(fs, rpath, *args, **kwargs)

    @property
    def shards(self) -> int:
        return sum(n for path, n in self.calls.items() if "/shards/" in path)


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_tiny_cache_bound_reads_the_local_batches_and_never_loses_a_pinned_shard(
    remote, local, monkeypatch, caplog, mode
):
    cache = Cache(local)
    sizes = [int(s["bytes"]) for s in cache.shards]
    assert len(sizes) >= 12, "the test needs many shards"
    pack = {"mode": "pack", "seq_len": 256, "packing": "concat", "attention": "none"}
    extra = pack if mode == "pack" else {}
    reference = ShardDataset(local, max_tokens=1024, seed=3, **extra)
    here, plan = list(reference), reference.plan()
    # room for the largest batch's shards and two more: the window is held back by the
    # bound, not by its depth
    largest = max(
        sum(sizes[s] for s in shards_of(cache.shard_starts, plan.batch(b)))
        for b in range(len(plan))
    )
    bound = largest + 2 * max(sizes)
    assert bound < sum(sizes) // 2
    monkeypatch.setenv("SHARDCACHE_CACHE_SIZE", str(bound))
    downloads = Downloads(monkeypatch)
    options = ReadAheadOptions(shards=16, threads=3)
    with ShardDataset(remote, max_tokens=1024, seed=3, readahead=options, **extra) as ds:
        for a, b in zip(ds, here, strict=True):
            assert_batches_equal(a, b)
        stats = ds.stats()
    assert stats["batches"] == len(here)
    # every download was the read-ahead's or a waiting batch's: no shard it held was
    # deleted under it and fetched again behind its back
    assert downloads.shards == stats["shards_ahead"] + stats["shards_on_demand"]
    assert stats["shards_ahead"] > 0
    assert not [r for r in caplog.records if "over SHARDCACHE_CACHE_SIZE" in r.getMessage()]


def test_dataloader_workers_read_ahead_their_own_batches(remote, local):
    from torch.utils.data import DataLoader

    here = list(ShardDataset(local, max_tokens=1024, seed=5))
    ds = ShardDataset(remote, max_tokens=1024, seed=5, readahead=ReadAheadOptions(shards=4))
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(got) == len(here)
    for a, b in zip(got, here):
        assert_batches_equal(a, b)


def test_a_flaky_store_still_yields_every_batch_exactly_once(remote, local, monkeypatch):
    downloads = Downloads(monkeypatch, fail_every=5)
    here = list(ShardDataset(local, max_tokens=1024, seed=7))
    with ShardDataset(remote, max_tokens=1024, seed=7, readahead=8) as ds:
        got = list(ds)
        stats = ds.stats()
    assert downloads.failed, "nothing failed: the test did not test a retry"
    assert stats["retried"] == len([p for p in downloads.failed if "/shards/" in p])
    assert len(got) == len(here)
    for a, b in zip(got, here):
        assert_batches_equal(a, b)
    ids = np.concatenate([b["meta"]["sample_ids"].numpy() for b in got])
    assert sorted(ids.tolist()) == sorted(
        np.concatenate([b["meta"]["sample_ids"].numpy() for b in here]).tolist()
    )


def test_a_shard_the_store_cannot_serve_fails_at_its_batch_naming_it(remote, local, s3):
    from shardcache.errors import CacheError

    ds_local = ShardDataset(local, max_tokens=1024, seed=1)
    plan, starts = ds_local.plan(), Cache(local).shard_starts
    order = [shards_of(starts, plan.batch(b)) for b in range(len(plan))]
    victim = order[5][0]
    first_use = next(k for k, shards in enumerate(order) if victim in shards)
    name = Cache(local).shards[victim]["name"]
    s3.delete_object(Bucket="corpus", Key=f"caches/ra/shards/{name}")
    ds = ShardDataset(remote, max_tokens=1024, seed=1, readahead=8)
    got = 0
    with pytest.raises(CacheError, match=re.escape(f"s3://corpus/caches/ra/shards/{name}")) as err:
        for _ in ds:
            got += 1
    assert got == first_use  # every batch before it arrived; the error came at its batch
    assert "missing from the store" in str(err.value)
    ds.close()


def test_resume_mid_epoch_reads_ahead_from_the_resumed_position(
    remote, local, monkeypatch, tmp_path
):
    whole = list(ShardDataset(local, max_tokens=1024, seed=9))
    first = ShardDataset(remote, max_tokens=1024, seed=9)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    first.close()
    # another machine: an empty local shard cache
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path / "other-machine"))
    downloads = Downloads(monkeypatch)
    resumed = ShardDataset(remote, max_tokens=1024, seed=9)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(whole) - 7
    for a, b in zip(rest, whole[7:]):
        assert_batches_equal(a, b)
    plan, starts = resumed.plan(), Cache(local).shard_starts
    needed = {s for b in range(7, len(plan)) for s in shards_of(starts, plan.batch(b))}
    assert downloads.shards == len(needed)  # nothing of the batches before the cursor
    resumed.close()


def _our_descriptors() -> list[str]:
    folder = os.environ["SHARDCACHE_CACHE_DIR"]
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(folder):
            found.append(target)
    return found


def _readahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shardcache-readahead")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_an_early_stop_leaves_no_thread_or_descriptor(remote):
    ds = ShardDataset(remote, max_tokens=1024, seed=2, readahead=ReadAheadOptions(shards=8))
    for _ in range(3):  # generator closed by hand, dropped, and ds.close() mid-pass
        it = iter(ds)
        next(it)
        next(it)
        it.close()
        assert not _readahead_threads()
    it = iter(ds)
    next(it)
    del it
    assert not _readahead_threads()
    it = iter(ds)
    next(it)
    assert _readahead_threads()
    ds.close()
    assert not _readahead_threads()
    assert _our_descriptors() == []
    logging.getLogger("shardcache").debug("leftover iterator: %s", it)


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_each_rank_fetches_its_share_once_with_a_folder_of_its_share(
    remote, local, monkeypatch, tmp_path, mode
):
    world = 4
    cache = Cache(local)
    sizes = [int(s["bytes"]) for s in cache.shards]
    share = sum(sizes) / world
    pack = {"mode": "pack", "seq_len": 256, "packing": "concat", "attention": "none"}
    extra = pack if mode == "pack" else {}
    window = 4
    # the rank's share and the read-ahead window, far less than the cache
    monkeypatch.setenv("SHARDCACHE_CACHE_SIZE", str(int(share + (window + 2) * max(sizes))))
    delivered = []
    for rank in range(world):
        monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path / f"node-{rank}"))
        downloads = Downloads(monkeypatch)
        with ShardDataset(
            remote, max_tokens=1024, seed=2, rank=rank, world_size=world, readahead=window, **extra
        ) as ds:
            assert ds.options.streams == world
            # (a packed batch's padding segment has sample id -1)
            delivered += [[i for i in b["meta"]["sample_ids"].tolist() if i >= 0] for b in ds]
            stats = ds.stats()
        shard_calls = [n for path, n in downloads.calls.items() if "/shards/" in path]
        assert max(shard_calls) == 1  # never the same bytes twice in the epoch
        fetched = stats["bytes_ahead"] + stats["bytes_on_demand"]
        assert fetched == pytest.approx(stats["fetched_over_share"] * share)
        # its streams' shards (boundary shards and the tail's few batches besides)
        assert fetched <= 1.3 * share, (rank, fetched / share)
    whole = ShardDataset(local, max_tokens=1024, seed=2, streams=world, **extra)
    plan = whole.plan()
    kept = len(plan) - len(plan) % world
    assert sorted(map(tuple, delivered)) == sorted(
        tuple(plan.batch(j).tolist()) for j in range(kept)
    )
