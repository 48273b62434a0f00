from __future__ import annotations

import collections
import copy
import dataclasses
import io
import itertools
import json
import pickle
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from conftest import assert_batches_equal, assert_resumable
from shardcache import ConfigError, PlanOptions, ShardDataset, StateError, open_cache
from shardcache.read.batch import Batch
from shardcache.read.selection.units import cache_digest


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=3, docs=60)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="8,16,32")


def _stream(ds, num_workers):
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()} for b in loader]


@pytest.mark.parametrize("packed", [False, True])
def test_ids_dtype_chooses_the_type_of_ids_positions_and_masks(cache_dir, packed):
    extra = {"mode": "pack", "seq_len": 64, "attention": "none"} if packed else {}
    first = {}
    for name, dtype in (("int32", torch.int32), ("int64", torch.int64)):
        ds = ShardDataset(cache_dir, max_tokens=256, seed=1, ids_dtype=name, **extra)
        batch = next(iter(ds))
        other = "position_ids" if packed else "attention_mask"
        assert batch["input_ids"].dtype == batch[other].dtype == dtype
        assert batch["labels"].dtype == torch.int64  # what torch's cross-entropy takes
        first[name] = batch
    for key in ("input_ids", "labels", "position_ids" if packed else "attention_mask"):
        assert torch.equal(first["int32"][key].long(), first["int64"][key])


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("extra", [{}, {"mode": "pack", "seq_len": 64, "attention": "none"},
                                   {"mode": "pack", "seq_len": 48, "packing": "concat",
                                    "attention": "none"}])  # fmt: skip
def test_num_tokens_counts_the_tokens_of_a_batch_without_its_padding(cache_dir, extra, compiled):
    ds = ShardDataset(cache_dir, max_tokens=256, seed=2, **extra)
    ds.kernels = compiled
    cache = open_cache(cache_dir)
    padded = 0
    for batch in ds:
        meta = batch["meta"]
        if "attention_mask" in batch:
            real = int(batch["attention_mask"].sum())
        else:  # padding runs are the segments of sample id -1
            lengths = meta["cu_seqlens"][1:] - meta["cu_seqlens"][:-1]
            real = int(lengths[meta["sample_ids"] >= 0].sum())
        assert meta["num_tokens"] == real and type(meta["num_tokens"]) is int
        padded += batch["input_ids"].numel() - real
    assert padded > 0  # the batches hold padding the count leaves out
    assert cache.num_tokens == sum(b["meta"]["num_tokens"] for b in ds)


def test_an_unknown_ids_dtype_is_refused(cache_dir):
    with pytest.raises(ConfigError, match="ids_dtype"):
        ShardDataset(cache_dir, max_tokens=256, ids_dtype="int16")


def test_batches_are_padded_within_budget_and_cover_every_sequence(cache_dir):
    cache = open_cache(cache_dir)
    ds = ShardDataset(cache_dir, max_tokens=256, seed=3)
    batches = _stream(ds, 0)
    seen = collections.Counter()
    for b in batches:
        ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
        assert ids.dtype == mask.dtype == torch.int32 and labels.dtype == torch.int64
        assert ids.shape == mask.shape == labels.shape
        assert ids.shape[0] * ids.shape[1] <= 256
        assert torch.equal(labels[mask == 0], torch.full_like(labels[mask == 0], -100))
        assert torch.equal(labels[mask == 1], ids[mask == 1])
        assert torch.all(ids[mask == 0] == cache.pad_id)
        buckets = cache.buckets()[b["meta"]["sample_ids"].numpy()]
        assert len(set(buckets.tolist())) == 1
        for row, sid in enumerate(b["meta"]["sample_ids"].tolist()):
            n = int(mask[row].sum())
            assert ids[row, :n].tolist() == cache.read(sid).tolist()
            seen[sid] += 1
    assert sorted(seen) == list(range(cache.num_sequences)) and set(seen.values()) == {1}


@pytest.mark.parametrize("num_workers", [1, 2])
def test_stream_independent_of_num_workers(cache_dir, num_workers):
    ds = ShardDataset(cache_dir, max_tokens=128, seed=0)
    base = [b["meta"]["sample_ids"].tolist() for b in _stream(ds, 0)]
    other = [b["meta"]["sample_ids"].tolist() for b in _stream(ds, num_workers)]
    assert base == other


def test_ranks_partition_batches_with_equal_counts(cache_dir):
    world = 3
    streams = [
        [
            b["meta"]["sample_ids"].tolist()
            for b in _stream(ShardDataset(cache_dir, max_tokens=128, rank=r, world_size=world), 0)
        ]
        for r in range(world)
    ]
    assert len({len(s) for s in streams}) == 1
    flat = [sid for s in streams for b in s for sid in b]
    assert len(flat) == len(set(flat))
    ds = ShardDataset(cache_dir, max_tokens=128, world_size=world, rank=0)
    assert ds.batches_per_rank() == len(streams[0])


def test_set_epoch_reshuffles(cache_dir):
    ds = ShardDataset(cache_dir, max_tokens=128, seed=0)
    first = [b["meta"]["sample_ids"].tolist() for b in _stream(ds, 0)]
    ds.set_epoch(1)
    second = [b["meta"]["sample_ids"].tolist() for b in _stream(ds, 0)]
    assert first != second
    assert sorted(x for b in first for x in b) == sorted(x for b in second for x in b)


def test_pad_to_multiple_of(cache_dir):
    ds = ShardDataset(cache_dir, max_tokens=512, pad_to_multiple_of=8)
    batches = list(_stream(ds, 0))
    assert batches, "the epoch yielded no batch"
    widths = [b["input_ids"].shape[1] for b in batches]
    longest = [int(b["attention_mask"].sum(dim=1).max()) for b in batches]
    assert all(w % 8 == 0 and w - 8 < n <= w for w, n in zip(widths, longest)), (widths, longest)
    assert any(w > n for w, n in zip(widths, longest)), "no batch needed rounding up"


# ---- helpers ---------------------------------------------------------------------------------


class _FakeWorkers:
    """Runs DataLoader workers in-process: ``get_worker_info`` answers for the worker whose
    iterator is being created, and the DataLoader's round-robin collection order is replayed.
    (Real worker processes are exercised by a few small tests; this keeps properties fast.)"""

    def __init__(self, monkeypatch):
        self.current = None
        monkeypatch.setattr("shardcache.read.dataset.get_worker_info", lambda: self.current)

    def start(self, ds, worker_id, num_workers):
        self.current = types.SimpleNamespace(id=worker_id, num_workers=num_workers)
        try:
            return iter(ds)
        finally:
            self.current = None

    def run(self, copies, first=0, on_item=None):
        """Round-robin over the workers' iterators from worker ``first``; exhausted workers
        are skipped from then on (what DataLoader does for iterable datasets)."""
        iterators = [self.start(c, w, len(copies)) for w, c in enumerate(copies)]
        active, w = [True] * len(copies), first
        while any(active):
            if active[w]:
                try:
                    item = next(iterators[w])
                except StopIteration:
                    active[w] = False
                else:
                    if on_item is not None and on_item(w, item) is False:
                        return
            w = (w + 1) % len(copies)


def _ids(batch):
    return batch["meta"]["sample_ids"].tolist()


def _key(batch):
    if "sample_offsets" in batch["meta"]:
        return list(zip(_ids(batch), batch["meta"]["sample_offsets"].tolist()))
    return _ids(batch)


PACK = {"mode": "pack", "attention": "none"}
MODES = [{}, {**PACK, "seq_len": 64}, {**PACK, "seq_len": 48, "packing": "concat"}]


# ---- packed batches --------------------------------------------------------------------------


@pytest.mark.parametrize("packing", ["best_fit", "concat"])
def test_packed_batches_restart_positions_and_never_cross_documents(cache_dir, packing):
    cache = open_cache(cache_dir)
    seq_len = 64 if packing == "best_fit" else 40
    ds = ShardDataset(cache_dir, 256, mode="pack", seq_len=seq_len, packing=packing,
                      attention="none")  # fmt: skip
    covered = collections.defaultdict(list)
    for b in _stream(ds, 0):
        ids, labels, pos = b["input_ids"], b["labels"], b["position_ids"]
        rows = ids.shape[0]
        assert ids.shape == labels.shape == pos.shape == (rows, seq_len) and rows <= 256 // seq_len
        cu = b["meta"]["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == rows * seq_len
        assert b["meta"]["cu_seqlens"].dtype == torch.int32
        lengths = [b - a for a, b in itertools.pairwise(cu)]
        assert b["meta"]["max_seqlen"] == max(lengths)
        flat_ids, flat_labels, flat_pos = ids.flatten(), labels.flatten(), pos.flatten()
        for k, (sid, offset) in enumerate(zip(_ids(b), b["meta"]["sample_offsets"].tolist())):
            a, e = cu[k], cu[k + 1]
            assert a // seq_len == (e - 1) // seq_len  # a segment never spans two rows
            assert flat_pos[a:e].tolist() == list(range(e - a))
            assert flat_labels[a] == -100  # the first token predicts nothing across a boundary
            if sid < 0:
                assert torch.all(flat_ids[a:e] == cache.pad_id)
                assert torch.all(flat_labels[a:e] == -100)
                continue
            tokens = cache.read(sid)[offset : offset + e - a].tolist()
            assert (
                flat_ids[a:e].tolist() == tokens and flat_labels[a + 1 : e].tolist() == tokens[1:]
            )
            covered[sid].append((offset, e - a))
    assert sorted(covered) == list(range(cache.num_sequences))
    for sid, pieces in covered.items():
        assert sum(n for _, n in pieces) == len(cache.read(sid))
        assert len(pieces) == 1 or packing == "concat"


# ---- ranks, workers, tail --------------------------------------------------------------------


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(1, 8), st.integers(0, 4), st.sampled_from(range(len(MODES))),
       st.sampled_from([128, 256]), st.sampled_from(["drop", "wrap"]))  # fmt: skip
def test_ranks_and_workers_cover_the_plan_exactly(cache_dir, monkeypatch, world, workers,
                                                   mode, max_tokens, tail):  # fmt: skip
    fake = _FakeWorkers(monkeypatch)
    streams = []
    for rank in range(world):
        ds = ShardDataset(cache_dir, max_tokens, rank=rank, world_size=world, tail=tail,
                          **MODES[mode])  # fmt: skip
        stream = [_key(b) for b in ds]
        assert len(stream) == len(ds) == ds.batches_per_rank()
        if workers:
            got: list = []
            fake.run([copy.deepcopy(ds) for _ in range(workers)],
                     on_item=lambda w, b, got=got: got.append(_key(b)))  # fmt: skip
            assert got == stream
        streams.append(stream)
        if rank == 0:
            report = ds.tail_report()
            plan = ds.plan()
    assert len({len(s) for s in streams}) == 1
    delivered = collections.Counter(map(repr, (b for s in streams for b in s)))
    planned = collections.Counter(repr(_key(ds.collate_batch(plan, i))) for i in range(len(plan)))
    assert sum(delivered.values()) == len(plan) - report["dropped_batches"] + report[
        "repeated_batches"]  # fmt: skip
    if tail == "drop":
        assert set(delivered.values()) <= {1} and delivered.keys() <= planned.keys()
        assert report["dropped_batches"] == len(plan) % world
    else:
        assert delivered.keys() == planned.keys() and report["repeated_batches"] < world


def test_tail_report_counts_what_is_dropped(cache_dir):
    ds = ShardDataset(cache_dir, 128, rank=0, world_size=7)
    report = ds.tail_report()
    plan = ds.plan()
    dropped = range(len(plan) - report["dropped_batches"], len(plan))
    assert report["dropped_segments"] == sum(len(plan.batch(i)) for i in dropped)
    assert report["batches_per_rank"] == len(plan) // 7 == len(ds)


# ---- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [*MODES, {"tail": "wrap"}])
@pytest.mark.parametrize("rank,world", [(0, 1), (1, 3)])
def test_resume_at_every_step_gives_the_remaining_stream(cache_dir, extra, rank, world):
    def make():
        return ShardDataset(cache_dir, 192, seed=5, rank=rank, world_size=world, **extra)

    full = assert_resumable(make, lambda ds: ds, key=_key)
    assert len(full) > 3


def test_resume_across_epochs_and_set_epoch_semantics(cache_dir):
    ds = ShardDataset(cache_dir, 128, seed=1)
    ds.set_epoch(2)
    it = iter(ds)
    head = [_ids(next(it)) for _ in range(3)]
    state = ds.state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 3
    resumed = ShardDataset(cache_dir, 128, seed=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the resumed epoch: keeps the cursor
    rest = [_ids(b) for b in resumed]
    fresh = ShardDataset(cache_dir, 128, seed=1)
    fresh.set_epoch(2)
    assert head + rest == [_ids(b) for b in fresh]
    assert resumed.state_dict()["consumed"] == len(head) + len(rest)  # epoch exhausted
    assert [_ids(b) for b in resumed] == head + rest  # a new pass replays the epoch
    resumed.set_epoch(3)  # a new epoch starts at 0
    assert resumed.state_dict()["consumed"] == 0 and len(resumed) == resumed.batches_per_rank()


def test_stateful_dataloader_worker_protocol(cache_dir, monkeypatch):
    """Replays torchdata's StatefulDataLoader with workers: it snapshots each worker's dataset
    state after every batch it hands out, restores each snapshot into the worker with the same
    id, and continues the round-robin after the last worker it yielded from."""
    fake = _FakeWorkers(monkeypatch)
    make = lambda: ShardDataset(cache_dir, 128, seed=2, rank=1, world_size=2)  # noqa: E731
    full = [_key(b) for b in make()]
    for num_workers in (2, 3):
        for k in range(len(full) + 1):
            copies = [copy.deepcopy(make()) for _ in range(num_workers)]
            # before any batch: the state each worker starts from
            snapshots = {w: c.state_dict() for w, c in enumerate(copies)}
            seen, last = [], [num_workers - 1]

            def on_item(w, batch, copies=copies, snapshots=snapshots, seen=seen, last=last, k=k):
                if len(seen) == k:  # this batch was produced (read ahead) but never handed out
                    return False
                seen.append(_key(batch))
                snapshots[w] = json.loads(json.dumps(copies[w].state_dict()))
                last[0] = w
                return None

            fake.run(copies, on_item=on_item)
            restored = []
            for w in range(num_workers):
                c = copy.deepcopy(make())
                c.load_state_dict(snapshots[w])
                restored.append(c)
            rest = []
            fake.run(restored, first=(last[0] + 1) % num_workers,
                     on_item=lambda w, b, rest=rest: rest.append(_key(b)))  # fmt: skip
            assert seen + rest == full, (num_workers, k)
            # the global cursor is the furthest worker's: resume with any num_workers from it
            cursor = max(s["consumed"] for s in snapshots.values())
            assert cursor == 2 * k  # world_size 2


def test_plain_dataloader_resumes_from_a_step_count_with_real_workers(cache_dir):
    make = lambda: ShardDataset(cache_dir, 128, seed=4, rank=0, world_size=2)  # noqa: E731
    full = [_ids(b) for b in _stream(make(), 2)]
    k = len(full) // 2 + 1
    ds = make()
    state = ds.state_dict(steps=k)  # the main process never sees the workers' progress
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [_ids(b) for b in _stream(resumed, 2)] == full[k:]  # another num_workers, too:
    resumed.load_state_dict(state)
    assert [_ids(b) for b in _stream(resumed, 0)] == full[k:]


@pytest.mark.parametrize("world,new_world", [(4, 2), (2, 3)])
@pytest.mark.parametrize("extra", [{}, {**PACK, "seq_len": 64}])
def test_elastic_resume_neither_repeats_nor_skips(cache_dir, world, new_world, extra):
    def make(rank, w):  # the run's streams, whatever the world size reading it
        return ShardDataset(cache_dir, 128, seed=3, rank=rank, world_size=w, streams=world, **extra)

    plan = make(0, 1).plan()
    first = [make(r, world) for r in range(world)]
    k = first[0].batches_per_rank() // 2
    head = []
    for ds in first:
        it = iter(ds)
        head += [_key(next(it)) for _ in range(k)]
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["consumed"] == k * world and state["world_size"] == world
    rest = []
    for r in range(new_world):
        ds = make(r, new_world)
        ds.load_state_dict(state)
        rest.append([_key(b) for b in ds])
    assert len({len(s) for s in rest}) == 1
    delivered = sorted(map(repr, head + [b for s in rest for b in s]))
    remaining = len(plan) - k * world
    kept = len(plan) - remaining % new_world
    planned = sorted(repr(_key(make(0, 1).collate_batch(plan, i))) for i in range(kept))
    assert delivered == planned


# ---- state validation ------------------------------------------------------------------------


def test_state_of_another_cache_or_plan_is_refused(cache_dir, corpus, build_cache, tokenizer_dir):
    state = ShardDataset(cache_dir, 128, seed=0).state_dict()
    with pytest.raises(StateError, match=r"plan options differ \(max_tokens: 128 -> 256"):
        ShardDataset(cache_dir, 256, seed=0).load_state_dict(state)
    with pytest.raises(StateError, match=r"seed: 0 -> 1"):
        ShardDataset(cache_dir, 128, seed=1).load_state_dict(state)
    with pytest.raises(StateError, match="mode: 'pad' -> 'pack'"):
        ShardDataset(cache_dir, 128, **PACK, seq_len=64).load_state_dict(state)
    folder, _ = corpus("jsonl", n_files=1, docs=20, seed=9)
    other = build_cache(folder, tokenizer_dir, max_length=64, truncation="split")
    with pytest.raises(StateError, match="cache with digest"):
        ShardDataset(other, 128, seed=0).load_state_dict(state)
    with pytest.raises(StateError, match="version"):
        ShardDataset(cache_dir, 128).load_state_dict({"epoch": 0})
    with pytest.raises(StateError, match="consumed=-1"):
        ShardDataset(cache_dir, 128).load_state_dict({**state, "consumed": -1})
    with pytest.raises(ConfigError, match="steps: got 10000"):
        ShardDataset(cache_dir, 128).state_dict(steps=10_000)


def test_cache_digest_prefers_the_cache_key():
    manifest = {"shards": [{"name": "a", "rows": 3}]}
    fallback = cache_digest(manifest)
    assert len(fallback) == 64 and fallback == cache_digest(dict(manifest))
    assert cache_digest({**manifest, "key": {"digest": "abc"}}) == "abc"
    assert cache_digest({"shards": [{"name": "b", "rows": 3}]}) != fallback


def test_options_object_and_keyword_errors(cache_dir):
    options = PlanOptions(max_tokens=256, mode="pack", seq_len=64)
    ds = ShardDataset(cache_dir, options=options, attention="mask")
    # the options given, streams=None resolved to the world size the reader starts with
    assert ds.options == dataclasses.replace(options, streams=1)
    with pytest.raises(ConfigError, match="either as options="):
        ShardDataset(cache_dir, 256, options=options)
    with pytest.raises(
        ConfigError, match=r"unknown batch option 'seqlen' \(did you mean 'seq_len'\?\)"
    ):
        ShardDataset(cache_dir, 256, seqlen=3)
    with pytest.raises(ConfigError, match="max_tokens: required"):
        ShardDataset(cache_dir)


def test_expect_refuses_a_cache_built_under_another_key(cache_dir, tokenizer_dir, tmp_path):
    from shardcache import CacheKeyMismatch
    from shardcache.store.key import manifest_key, write_lock

    cache = open_cache(cache_dir)
    key = manifest_key(cache.manifest, cache_dir)
    ShardDataset(cache_dir, max_tokens=256, expect=key)  # same key: fine
    lock = str(tmp_path / "shardcache.lock")
    write_lock(lock, key)
    ShardDataset(cache_dir, max_tokens=256, expect=lock)
    same = {"tokenizer": tokenizer_dir, "max_length": 64, "truncation": "split"}
    ShardDataset(cache_dir, max_tokens=256, expect=same)  # options: data is not compared
    with pytest.raises(CacheKeyMismatch, match=r"truncation\.max_length") as info:
        ShardDataset(cache_dir, max_tokens=256, expect={**same, "max_length": 32})
    assert ("truncation", "max_length", 64, 32) in info.value.differences


def test_zstd_cache_gives_the_same_batches_within_the_decode_budget(
    corpus, build_cache, tokenizer_dir, monkeypatch
):
    monkeypatch.setenv("SHARDCACHE_DECODE_BUDGET", "8KiB")
    folder, _ = corpus("jsonl", n_files=2, docs=60)
    opts = {"max_length": 64, "truncation": "split", "buckets": "8,16,32", "shard_size": 4096}
    plain = build_cache(folder, tokenizer_dir, **opts)
    packed = build_cache(folder, tokenizer_dir, compression="zstd", **opts)
    for mode in ({}, {"mode": "pack", "seq_len": 64, "packing": "concat", "attention": "mask"}):
        want = _stream(ShardDataset(plain, max_tokens=256, seed=2, **mode), 0)
        got = []
        ds = ShardDataset(packed, max_tokens=256, seed=2, **mode)
        for batch in ds:
            decoded = ds._selection._cache._shards.decoded
            assert decoded.nbytes <= (8 << 10) + (4 << 10)  # the budget + one record batch
            got.append(batch)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_batches_equal(a, b)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
@pytest.mark.parametrize(
    ("context", "stateful"), [("fork", False), ("forkserver", False), ("fork", True)]
)
def test_persistent_workers_deliver_every_epoch_whole_and_follow_set_epoch(
    cache_dir, context, stateful
):
    """With persistent_workers=True the workers keep their copy of the dataset across passes.
    Every pass must still deliver the whole epoch the main process selected: the same
    batches as an in-process pass (before the fix a second pass lost about half of them,
    and set_epoch in the main process never reached the workers, so a new epoch replayed the
    old order), after set_epoch and after load_state_dict too."""
    ds = ShardDataset(cache_dir, max_tokens=128, seed=3)
    reference = {}
    for epoch in (0, 1, 2):
        other = ShardDataset(cache_dir, max_tokens=128, seed=3)
        other.set_epoch(epoch)
        reference[epoch] = [_ids(b) for b in other]
    kind = DataLoader
    if stateful:  # torchdata's StatefulDataLoader keeps persistent workers the same way
        from torchdata.stateful_dataloader import StatefulDataLoader as kind
    loader = kind(ds, batch_size=None, num_workers=2, persistent_workers=True,
                  multiprocessing_context=context)  # fmt: skip

    def one_pass():
        return sorted(tuple(_ids(b)) for b in loader)

    def whole(epoch):
        return sorted(tuple(ids) for ids in reference[epoch])

    assert one_pass() == whole(0)
    assert one_pass() == whole(0)  # the same epoch again: replayed whole
    ds.set_epoch(1)
    assert one_pass() == whole(1)  # the new epoch's order, not epoch 0's
    state = ds.state_dict()
    ds.set_epoch(2)
    assert one_pass() == whole(2)
    resumed = copy.deepcopy(state)
    resumed["consumed"] = 4
    ds.load_state_dict(resumed)  # epoch 1 from global batch 4: the rest of it
    assert one_pass() == sorted(tuple(ids) for ids in reference[1][4:])
    assert one_pass() == whole(1)  # and then the whole epoch again


# ---- a Batch pickles as one storage (DataLoader workers hand over one segment a batch) -------


def _batch() -> Batch:
    return Batch(
        input_ids=torch.arange(30, dtype=torch.int32).reshape(3, 10),
        labels=torch.arange(30, dtype=torch.int64).reshape(3, 10) - 7,
        attention_mask=torch.ones(3, 10, dtype=torch.bool),
        meta={
            "sample_ids": torch.tensor([4, 9, 1]),
            "cu_seqlens": torch.tensor([0, 10, 20, 30], dtype=torch.int32),
            "empty": torch.zeros(0, 5, dtype=torch.int16),
            "max_seqlen": 10,
        },
    )


def _storages(batch: dict) -> set[int]:
    tensors = [v for v in batch.values() if torch.is_tensor(v)]
    tensors += [v for v in batch.get("meta", {}).values() if torch.is_tensor(v)]
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


@pytest.mark.parametrize("pickler", ["pickle", "forking"])
def test_a_batch_pickles_as_one_storage(pickler):
    batch = _batch()
    if pickler == "pickle":
        back = pickle.loads(pickle.dumps(batch))
    else:
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(batch)
        back = pickle.loads(buffer.getvalue())
    assert type(back) is Batch and list(back) == list(batch)
    assert_batches_equal(back, batch)
    assert back["meta"]["max_seqlen"] == 10 and list(back["meta"]) == list(batch["meta"])
    assert len(_storages(back)) == 1 < len(_storages(batch))


def test_what_cannot_travel_as_one_storage_pickles_as_before():
    batch = _batch()
    batch["labels"] = batch["labels"].float().requires_grad_()
    back = pickle.loads(pickle.dumps(batch))
    assert torch.equal(back["labels"], batch["labels"]) and back["labels"].requires_grad
    assert torch.equal(back["meta"]["sample_ids"], batch["meta"]["sample_ids"])
    plain = Batch(x=1, meta={"y": 2})
    assert pickle.loads(pickle.dumps(plain)) == plain


def test_copy_is_shallow_and_deepcopy_copies_the_data():
    batch = _batch()
    shallow = copy.copy(batch)
    assert type(shallow) is Batch and shallow["input_ids"] is batch["input_ids"]
    deep = copy.deepcopy(batch)
    assert_batches_equal(deep, batch)
    deep["input_ids"][0, 0] = 99
    assert batch["input_ids"][0, 0] == 0


def test_batches_from_a_worker_arrive_whole_in_one_storage(cache_dir):
    path = cache_dir
    options = {"max_tokens": 256, "seed": 1, "mode": "pack", "seq_len": 64, "attention": "none"}
    expected = list(ShardDataset(path, **options))
    got = list(DataLoader(ShardDataset(path, **options), batch_size=None, num_workers=1))
    assert len(got) == len(expected) > 1
    for a, b in zip(got, expected):
        assert_batches_equal(a, b)
        assert len(_storages(a)) == 1
