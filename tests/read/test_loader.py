"""``shardcache.loader``: the DataLoader set-up, exact resume through workers and a prefetcher,
and the refusal of a DataLoader that collates whole batches into a leading dimension."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import shardcache
from shardcache import ConfigError, ShardDataset


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="16,32")


def ids(batches) -> list[list[int]]:
    return [b["meta"]["sample_ids"].tolist() for b in batches]


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_dataloader_that_collates_batches_is_refused(cache_dir, batch_size):
    ds = ShardDataset(cache_dir, 128, seed=1)
    with pytest.raises(ConfigError, match=r"use DataLoader\(ds, batch_size=None\)"):
        next(iter(DataLoader(ds, batch_size=batch_size)))
    batch = next(iter(DataLoader(ds, batch_size=None)))
    assert batch["input_ids"].dim() == 2


def test_the_refusal_reaches_the_training_loop_from_a_worker(cache_dir):
    ds = ShardDataset(cache_dir, 128, seed=1)
    with pytest.raises(ConfigError, match=r"batch_size=None"):
        next(iter(DataLoader(ds, num_workers=1, timeout=120)))


def test_loader_configures_the_dataloader(cache_dir):
    dl = shardcache.loader(cache_dir, 128, num_workers=2, seed=1)
    assert isinstance(dl, shardcache.ShardLoader) and dl.prefetcher is None
    inner = dl.dataloader
    assert inner.batch_size is None and inner.num_workers == 2
    assert inner.multiprocessing_context.get_start_method() == "forkserver"
    assert not inner.persistent_workers and not inner.pin_memory
    expected = ids(ShardDataset(cache_dir, 128, seed=1))
    assert ids(dl) == expected and len(dl) == len(expected)


def test_loader_options_are_validated(cache_dir):
    with pytest.raises(ConfigError, match="mode='pack' needs attention="):
        shardcache.loader(cache_dir, 128, mode="pack", seq_len=64)
    with pytest.raises(ConfigError, match="num_workers: got -1"):
        shardcache.loader(cache_dir, 128, num_workers=-1)
    with pytest.raises(ConfigError, match="start_method: got 'threads'"):
        shardcache.loader(cache_dir, 128, start_method="threads")
    with pytest.raises(ConfigError, match="num_workers=0"):
        shardcache.loader(cache_dir, 128, num_workers=0, start_method="spawn")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_after_k_batches_resumes_the_rest_of_the_stream(cache_dir, num_workers):
    options = {"mode": "pack", "seq_len": 64, "attention": "mask", "seed": 2}
    full = ids(shardcache.loader(cache_dir, 128, num_workers=0, **options))
    assert len(full) >= 4
    dl = shardcache.loader(cache_dir, 128, num_workers=num_workers, device="cpu", **options)
    taken = []
    for batch in dl:
        taken.append(batch["meta"]["sample_ids"].tolist())
        if len(taken) == 3:
            break  # the workers and the prefetcher have read ahead by now
    state = dl.state_dict()
    dl.close()
    resumed = shardcache.loader(cache_dir, 128, num_workers=num_workers, **options)
    resumed.load_state_dict(state)
    assert taken + ids(resumed) == full
    # a finished pass ends the epoch; the next one reshuffles after set_epoch
    assert resumed.state_dict()["consumed"] == len(full)
    resumed.set_epoch(1)
    assert len(ids(resumed)) == len(full)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pass_left_early_continues_after_the_last_batch_handed_out(cache_dir, num_workers):
    full = ids(shardcache.loader(cache_dir, 128, num_workers=0, seed=3))
    dl = shardcache.loader(cache_dir, 128, num_workers=num_workers, device="cpu", seed=3)
    head = []
    for batch in dl:
        head.append(batch["meta"]["sample_ids"].tolist())
        if len(head) == 2:
            break
    dl.set_epoch(0)  # the current epoch: keeps the position
    middle = []
    for batch in dl:
        middle.append(batch["meta"]["sample_ids"].tolist())
        if len(middle) == 2:
            break
    assert head + middle + ids(dl) == full
    dl.close()


def test_stateful_dataloader_resumes_the_stream(cache_dir):
    full = ids(shardcache.loader(cache_dir, 128, num_workers=0, seed=4))
    dl = shardcache.loader(cache_dir, 128, num_workers=0, seed=4, stateful=True)
    it = iter(dl.dataloader)
    head = [next(it)["meta"]["sample_ids"].tolist() for _ in range(2)]
    state = dl.dataloader.state_dict()
    again = shardcache.loader(cache_dir, 128, num_workers=0, seed=4, stateful=True)
    again.dataloader.load_state_dict(state)
    assert head + ids(again.dataloader) == full


def test_prefetcher_hands_out_batches_on_the_device(cache_dir):
    with shardcache.loader(cache_dir, 128, num_workers=0, device="cpu", seed=1) as dl:
        assert dl.prefetcher is not None
        batch = next(iter(dl))
    assert batch["input_ids"].device == torch.device("cpu")
    assert set(batch["meta"]) == {"sample_ids", "num_tokens"}


def test_persistent_workers_follow_set_epoch_and_a_pass_left_early(cache_dir):
    """loader(persistent_workers=True) keeps its workers; every pass still delivers what
    fresh workers would: the epoch set, a whole replay, and after a pass left early the
    batches after the last one handed out."""
    expected = {}
    for epoch in (0, 1):
        ds = ShardDataset(cache_dir, 128, seed=1)
        ds.set_epoch(epoch)
        expected[epoch] = ids(ds)
    with pytest.raises(ConfigError, match="persistent_workers=True with num_workers=0"):
        shardcache.loader(cache_dir, 128, num_workers=0, persistent_workers=True)
    dl = shardcache.loader(cache_dir, 128, num_workers=2, persistent_workers=True, seed=1)
    assert dl.dataloader.persistent_workers
    assert ids(dl) == expected[0]
    assert ids(dl) == expected[0]
    dl.set_epoch(1)
    head = []
    for batch in dl:
        head.append(batch["meta"]["sample_ids"].tolist())
        if len(head) == 3:
            break
    assert head + ids(dl) == expected[1]


def test_by_default_a_cache_the_kernels_read_is_read_in_process(cache_dir, corpus, build_cache,
                                                                tokenizer_dir):  # fmt: skip
    """Receiving a batch from a worker costs the main process more than building it with the
    compiled kernels, so those caches get no workers; a zstd cache (numpy path) gets 2, and
    so does a loader whose options ask for workers."""
    pytest.importorskip("numba")
    dl = shardcache.loader(cache_dir, 128, seed=1)
    assert dl.dataset.reads_compiled and dl.dataloader.num_workers == 0
    assert ids(dl) == ids(ShardDataset(cache_dir, 128, seed=1))
    assert shardcache.loader(cache_dir, 128, start_method="fork").dataloader.num_workers == 2
    assert shardcache.loader(cache_dir, 128, persistent_workers=True).dataloader.num_workers == 2
    folder, _ = corpus("jsonl", n_files=1, docs=20, seed=1)
    packed = build_cache(folder, tokenizer_dir, compression="zstd")
    zstd = shardcache.loader(packed, 128)
    assert not zstd.dataset.reads_compiled and zstd.dataloader.num_workers == 2


def _live_workers() -> list:
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.is_alive()]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("monitored", [False, True])
def test_an_interrupted_pass_stops_its_workers_when_the_loader_closes(
    cache_dir, persistent, monitored
):
    """Ctrl-C in a loop over a ``with loader(...)`` (``shardcache profile -w 64``): leaving the
    block stops the DataLoader's workers and frees their queues' semaphores at once, while the
    KeyboardInterrupt's traceback still holds the loop's frames (before, the workers lived until
    the interpreter exited, and a second Ctrl-C's ``os._exit`` leaked their semaphores)."""
    assert not _live_workers()
    caught = None
    try:
        with shardcache.loader(cache_dir, 256, num_workers=2,
                               persistent_workers=persistent) as batches:  # fmt: skip
            stream = shardcache.StallMonitor(warn_pct=None).wrap(batches) if monitored else batches
            for _ in stream:
                raise KeyboardInterrupt
    except KeyboardInterrupt as err:
        caught = err  # the traceback keeps every frame of the loop alive
    assert caught is not None and caught.__traceback__ is not None
    assert not _live_workers()
