"""A batch crosses from a DataLoader worker as one storage (transport.py, Batch pickling)."""

from __future__ import annotations

import copy
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing
from torch.utils.data import DataLoader

from conftest import assert_batches_equal
from shardcache import ShardDataset
from shardcache.read import transport
from shardcache.read.dataset import Batch


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


def test_pack_and_unpack_give_the_tensors_back_as_views_of_one_storage():
    tensors = [
        torch.arange(7, dtype=torch.int8),
        torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # not contiguous
        torch.zeros(0, dtype=torch.int32),
        torch.tensor([True, False, True]),
    ]
    flat, specs = transport.pack(tensors)
    back = transport.unpack(flat, specs)
    for a, b in zip(tensors, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert all(offset % transport.ALIGN == 0 for _, _, offset, _ in specs)


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


def test_batches_from_a_worker_arrive_whole_in_one_storage(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=30)
    path = build_cache(folder, tokenizer_dir, max_length=64, truncation="split")
    options = {"max_tokens": 256, "seed": 1, "mode": "pack", "seq_len": 64, "attention": "none"}
    expected = list(ShardDataset(path, **options))
    got = list(DataLoader(ShardDataset(path, **options), batch_size=None, num_workers=1))
    assert len(got) == len(expected) > 1
    for a, b in zip(got, expected):
        assert_batches_equal(a, b)
        assert len(_storages(a)) == 1
