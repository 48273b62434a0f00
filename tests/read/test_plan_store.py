"""The epoch plan is computed once per machine and epoch and shared (read/plan/plan_store.py)."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader

from conftest import assert_batches_equal
from shardcache import PlanOptions, ShardDataset, plan_epoch
from shardcache.read.plan import plan_store
from shardcache.read.selection import selection


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=60)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="8,32")


@pytest.fixture()
def planned(tmp_path, monkeypatch):
    """Calls of plan_epoch by ShardDataset in this process and its forked workers."""
    monkeypatch.setattr(plan_store, "SHARE_MIN_SEQUENCES", 0)  # share even a small plan
    log = tmp_path / "planned.log"
    log.write_text("")
    real = selection.plan_epoch

    def counting(lengths, buckets, options, seed, epoch):
        with open(log, "a") as f:
            f.write(f"{epoch}\n")
        return real(lengths, buckets, options, seed, epoch)

    monkeypatch.setattr(selection, "plan_epoch", counting)
    return lambda: [int(x) for x in log.read_text().split()]


def _stream(ds, workers: int) -> list[dict]:
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    return list(loader)


@pytest.mark.parametrize(
    "mode", [{}, {"mode": "pack", "seq_len": 64, "packing": "best_fit", "attention": "varlen"}]
)
def test_workers_of_every_epoch_share_one_plan(cache_dir, planned, mode):
    ds = ShardDataset(cache_dir, max_tokens=256, seed=4, **mode)
    streams = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        streams.append(_stream(ds, 2))
    # fresh workers each epoch, two of them: one plan computation per epoch in all
    assert planned() == [0, 1]
    reference = ShardDataset(cache_dir, max_tokens=256, seed=4, **mode)
    for epoch, got in zip((0, 1), streams):
        reference.set_epoch(epoch)
        want = list(reference)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_batches_equal(a, b)


def test_a_stored_plan_reads_back_equal_and_other_inputs_get_their_own(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, 500)
    buckets = (lengths > 30).astype(np.int32)
    options = PlanOptions(max_tokens=256, mode="pack", seq_len=64, packing="concat")
    calls = []

    def compute(seed):
        calls.append(seed)
        return plan_epoch(lengths, buckets, options, seed=seed)

    for seed in (1, 1, 2, 1):
        digest = plan_store.plan_digest("data", "opts", seed, 0)
        plan = plan_store.shared_plan(digest, 10**9, lambda s=seed: compute(s))
        want = plan_epoch(lengths, buckets, options, seed=seed)
        for name in ("batch_offsets", "sample_ids", "row_offsets", "seg_starts", "seg_lengths"):
            assert np.array_equal(getattr(plan, name), getattr(want, name))
    assert calls == [1, 2]


@pytest.mark.parametrize("damage", ["swap", "truncate", "digests"])
def test_an_edited_stored_plan_is_never_used(cache_dir, planned, damage):
    """A stored plan edited in place (two sample ids swapped: silently other batches; a file
    cut short: a raw ValueError; the digest file itself edited) is detected, removed and
    computed again."""
    import json
    import os

    from shardcache.store.files import cache_root

    ds = ShardDataset(cache_dir, max_tokens=256, seed=7)
    want = list(ds)
    (folder,) = [e.path for e in os.scandir(os.path.join(cache_root(), plan_store.PLANS_DIR))
                 if e.is_dir()]  # fmt: skip
    path = os.path.join(folder, "sample_ids.npy")
    if damage == "swap":
        ids = np.load(path, mmap_mode="r+")
        ids[0], ids[-1] = int(ids[-1]), int(ids[0])
        ids.flush()
        del ids
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 8)
    else:
        digests = os.path.join(folder, plan_store.DIGESTS_FILE)
        with open(digests, encoding="utf-8") as f:
            recorded = json.load(f)
        recorded["sample_ids.npy"] = "0" * 64
        with open(digests, "w", encoding="utf-8") as f:
            json.dump(recorded, f)
    again = ShardDataset(cache_dir, max_tokens=256, seed=7)
    got = list(again)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_batches_equal(a, b)
    assert planned() == [0, 0]  # computed again
