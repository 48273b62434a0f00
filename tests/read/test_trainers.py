"""ShardDataset under the trainers people use, in one process: accelerate's wrappers that split it
again (its dispatcher, transformers' Trainer through it, its IterableDatasetShard) are refused
before the first batch with the fix named; a ShardLoader passes through ``accelerator.prepare``;
a process group started after construction (Lightning's launcher) gives rank and world size.
tests/test_trainers_ddp.py runs the same under ``torchrun --nproc_per_node 2``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import shardcache
from shardcache import ConfigError, ShardDataset

accelerate = pytest.importorskip("accelerate")
from accelerate.data_loader import IterableDatasetShard  # noqa: E402
from trainer_ranks import CountingLM  # noqa: E402  (the model the torchrun runs train)

FIX = r"shardcache\.loader\(\.\.\.\).*get_train_dataloader"


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="16,32")


@pytest.fixture()
def accelerator(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    made = accelerate.Accelerator(cpu=True)
    yield made
    accelerate.state.AcceleratorState._reset_state(True)


def ids(batches) -> list[list[int]]:
    return [b["meta"]["sample_ids"].tolist() for b in batches]


def test_accelerate_dispatching_a_dataset_is_refused_at_start(cache_dir, accelerator):
    ds = ShardDataset(cache_dir, 128, seed=1)
    prepared = accelerator.prepare(DataLoader(ds, batch_size=None))
    with pytest.raises(ConfigError, match=rf"DataLoaderDispatcher: it reads every batch.*{FIX}"):
        len(prepared)
    with pytest.raises(ConfigError, match=rf"rank 0 of 1\) is being read .*{FIX}"):
        next(iter(prepared))


def test_accelerate_resharding_a_dataset_is_refused(cache_dir):
    ds = ShardDataset(cache_dir, 128, seed=1, rank=0, world_size=2)
    shard = IterableDatasetShard(ds, batch_size=1, num_processes=2, process_index=0)
    with pytest.raises(ConfigError, match=rf"IterableDatasetShard: it keeps one of every.*{FIX}"):
        shard.set_epoch(0)
    with pytest.raises(ConfigError, match="IterableDatasetShard"):
        next(iter(shard))
    with pytest.raises(ConfigError, match="IterableDatasetShard"):  # through a worker too
        next(iter(DataLoader(shard, batch_size=None, num_workers=1, timeout=120)))


def test_the_dataset_alone_and_a_plain_dataloader_are_not_refused(cache_dir, accelerator):
    # accelerate imported and an Accelerator made: only its wrappers are refused
    ds = ShardDataset(cache_dir, 128, seed=1)
    ds.set_epoch(0)
    assert len(ds) == len(DataLoader(ds, batch_size=None)) > 0
    assert ids(DataLoader(ds, batch_size=None)) == ids(ds)


def test_accelerate_passes_a_shard_loader_through(cache_dir, accelerator):
    loader = shardcache.loader(cache_dir, 128, seed=1, device=accelerator.device)
    with loader:
        assert accelerator.prepare(loader) is loader
        assert ids(loader) == ids(ShardDataset(cache_dir, 128, seed=1))


def hf_arguments(tmp_path, steps: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, per_device_train_batch_size=1,
    )  # fmt: skip


def test_hf_trainer_given_the_dataset_is_refused_before_a_step(cache_dir, tmp_path, monkeypatch):
    from transformers import Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ds = ShardDataset(cache_dir, 128, seed=1)
    model = CountingLM(int(shardcache.open_cache(cache_dir).manifest["tokenizer"]["vocab_size"]))
    trainer = Trainer(model=model, args=hf_arguments(tmp_path, 4), train_dataset=ds,
                      data_collator=lambda items: items[0])  # fmt: skip
    try:
        with pytest.raises(ConfigError, match=rf"DataLoaderDispatcher.*{FIX}"):
            trainer.train()
        assert model.seen == []
    finally:
        accelerate.state.AcceleratorState._reset_state(True)


def test_a_process_group_started_after_construction_gives_rank_and_world(cache_dir, monkeypatch):
    # Lightning's launcher starts the process group in fit(), after the script built the
    # dataset, and sets WORLD_SIZE but no RANK in the processes it starts
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = ShardDataset(cache_dir, 128, seed=1)
    given = ShardDataset(cache_dir, 128, seed=1, rank=0, world_size=2)
    assert (ds.rank, ds.world_size) == (0, 2)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    expected = ids(ShardDataset(cache_dir, 128, seed=1, rank=1, world_size=2))
    assert len(ds) == len(expected) and ids(ds) == expected
    assert (ds.rank, ds.world_size) == (1, 2) and ds.state_dict()["world_size"] == 2
    assert (given.rank, given.world_size) == (0, 2)  # passed explicitly: kept
