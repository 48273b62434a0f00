"""Elastic resume through torchdata's StatefulDataLoader (issue 12 item 5): states taken at
one world size and restored at another continue with exactly the global batches not yet
consumed (the tail of the new split aside), or refuse with a StateError that says how."""

from __future__ import annotations

import gc
import json

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from shardcache import ShardDataset, StateError

# torchdata 0.11 calls a torch API that torch >= 2.9 deprecates (a warning, not our code)
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=3, docs=60)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="8,16,32")


def _key(batch) -> tuple[int, ...]:
    return tuple(batch["meta"]["sample_ids"].tolist())


def _loader(ds: ShardDataset, num_workers: int) -> StatefulDataLoader:
    return StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)


def _take(ds: ShardDataset, num_workers: int, steps: int) -> tuple[list, dict]:
    """``steps`` batches through a StatefulDataLoader, then its checkpoint; its workers are
    shut down here (not when a later fork's child collects the iterator)."""
    loader = _loader(ds, num_workers)
    it = iter(loader)
    keys = [_key(next(it)) for _ in range(steps)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it, loader
    gc.collect()
    return keys, state


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("world", "new_world"), [(2, 4), (4, 2), (2, 2)])
def test_stateful_dataloader_states_resume_at_another_world_size(
    cache_dir, num_workers, world, new_world
):
    def make(rank: int, world_size: int) -> ShardDataset:  # the first job's streams throughout
        return ShardDataset(cache_dir, 128, seed=5, rank=rank, world_size=world_size, streams=world)

    plan = make(0, 1).plan()
    steps = make(0, world).batches_per_rank() // 2 + 1  # odd or even: workers mid-round
    head, states = [], []
    for rank in range(world):  # every rank trains `steps` steps, then checkpoints
        keys, state = _take(make(rank, world), num_workers, steps)
        head += keys
        states.append(state)
    rest: list[tuple[int, ...]] = []
    for rank in range(new_world):  # the new job: rank 0's checkpoint, or its own (same shape)
        loader = _loader(make(rank, new_world), num_workers)
        loader.load_state_dict(states[rank] if new_world == world else states[0])
        try:
            rest += [_key(b) for b in loader]
        except StateError as err:
            # in-process states carry the global cursor; worker states resume the same shape
            assert num_workers > 0 and new_world != world, err
            assert "ds.load_state_dict(loader_state)" in str(err), err
            # the way the message gives: the dataset takes the whole loader state
            del loader
            gc.collect()  # the refused loader's workers
            ds = make(rank, new_world)
            ds.load_state_dict(states[0])
            rest += [_key(b) for b in _loader(ds, num_workers)]
    delivered = head + rest
    assert len(delivered) == len(set(delivered)), "a batch was delivered twice"
    consumed = steps * world
    tail = (len(plan) - consumed) % new_world  # the documented tail of the new split
    expected = {tuple(plan.batch(i).tolist()) for i in range(len(plan) - tail)}
    assert set(delivered) == expected
    for state in states[1:]:  # any rank's checkpoint gives the same cursor
        ds = make(0, new_world)
        ds.load_state_dict(state)
        assert ds.state_dict()["consumed"] == consumed


def test_a_worker_state_restored_into_other_workers_is_refused(cache_dir):
    """Worker states of 2 workers at world size 2, restored at world size 4: a StateError
    naming both shapes and the way to resume, never a silent loss."""
    _, state = _take(ShardDataset(cache_dir, 128, seed=5, rank=0, world_size=2), 2, 3)
    resumed = _loader(ShardDataset(cache_dir, 128, seed=5, rank=0, world_size=4), 2)
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match=r"world_size 2.*world_size 4"):
        list(resumed)
    del resumed
    gc.collect()  # its workers are shut down here, not in some later test


@pytest.mark.parametrize(("world", "workers", "new_world", "new_workers"), [(2, 2, 3, 0)])
def test_a_transformed_stream_resumes_through_stateful_dataloader_checkpoints(
    cache_dir, world, workers, new_world, new_workers
):
    """A read-time transform's randomness is keyed by the sample, not by the worker or rank:
    checkpoints of ``world`` ranks with ``workers`` workers each resume at ``new_world`` ranks
    with ``new_workers`` workers, and every global batch's transformed tokens equal those of an
    uninterrupted run."""
    from shardcache import SpanMask

    def make(rank: int, world_size: int) -> ShardDataset:
        return ShardDataset(cache_dir, 128, seed=5, rank=rank, world_size=world_size,
                            streams=world, transform=SpanMask(0.3, 1))  # fmt: skip

    def tokens(batch) -> tuple[int, ...]:
        return tuple(batch["input_ids"][batch["attention_mask"].bool()].tolist())

    uninterrupted = {}  # global batch -> its transformed tokens, one process per rank
    for rank in range(world):
        ds = make(rank, world)
        for j, batch in zip(ds.split().for_rank(rank).tolist(), ds):
            uninterrupted[j] = tokens(batch)
    steps = make(0, world).batches_per_rank() // 2 + 1
    loader = _loader(make(0, world), workers)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it, loader
    gc.collect()
    resumed = {}
    for rank in range(new_world):
        ds = make(rank, new_world)
        ds.load_state_dict(state)  # the whole loader state, at another shape
        start = ds.state_dict()["consumed"]
        batches = list(_loader(ds, new_workers))
        for j, batch in zip(ds.split(start=start).for_rank(rank).tolist(), batches):
            resumed[j] = tokens(batch)
    assert resumed and min(resumed) == steps * world  # it continues where the ranks stopped
    changed = 0
    for j, got in resumed.items():
        if j in uninterrupted:  # (the new split's tail differs from the old one's)
            assert got == uninterrupted[j], f"global batch {j} differs after the resume"
            changed += 1
    assert changed >= len(resumed) - new_world
