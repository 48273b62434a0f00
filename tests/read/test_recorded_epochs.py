"""Whole epochs read from fixed, committed caches equal the batches recorded from the reader
as it was before its rewrite (pad, pack concat, pack best_fit; a plain, a chat and a zstd
cache; several seeds, ranks and epochs; compiled kernels on and off). The one-process cases
read with the default canonical streams (one stream of one block is the global plan); the
two-rank cases ask for the global plan (``streams=0``).

The caches under ``tests/read/data/epochs/`` were built once and committed, so the test does
not depend on the build pipeline. ``recorded_epochs.json`` holds, per case and batch, the
batch's keys in order with a sha256 prefix of each value (dtype, shape and bytes).
Regenerate (only when batch contents are meant to change)::

    python tests/read/test_recorded_epochs.py --record          # digests from the caches
    python tests/read/test_recorded_epochs.py --build --record  # caches too (needs the builder)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from typing import Any

import pytest
import torch

from shardcache import ShardDataset

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CACHES = os.path.join(DATA, "epochs")
RECORDED = os.path.join(DATA, "recorded_epochs.json")

#: name -> (cache, epoch, ShardDataset keywords)
CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "plain-pad": ("plain", 0, {"max_tokens": 512, "seed": 0}),
    "plain-pad-multiple-rank1": (
        "plain", 1, {"max_tokens": 512, "seed": 3, "pad_to_multiple_of": 8, "rank": 1,
                     "world_size": 2, "streams": 0}),
    "plain-pad-unshuffled": ("plain", 0, {"max_tokens": 384, "shuffle": False}),
    "plain-concat": (
        "plain", 0, {"max_tokens": 512, "seed": 1, "mode": "pack", "packing": "concat",
                     "seq_len": 48, "attention": "none"}),
    "plain-concat-mask-rank0": (
        "plain", 2, {"max_tokens": 256, "seed": 2, "mode": "pack", "packing": "concat",
                     "seq_len": 32, "attention": "mask", "rank": 0, "world_size": 2,
                     "ids_dtype": "int64", "streams": 0}),
    "plain-best-fit": (
        "plain", 0, {"max_tokens": 512, "seed": 4, "mode": "pack", "packing": "best_fit",
                     "seq_len": 64, "attention": "varlen"}),
    "chat-pad": ("chat", 0, {"max_tokens": 512, "seed": 0}),
    "chat-concat": (
        "chat", 1, {"max_tokens": 512, "seed": 5, "mode": "pack", "packing": "concat",
                    "seq_len": 64, "attention": "none"}),
    "chat-best-fit": (
        "chat", 0, {"max_tokens": 512, "seed": 6, "mode": "pack", "packing": "best_fit",
                    "seq_len": 128, "attention": "none"}),
    "zstd-pad": ("zstd", 0, {"max_tokens": 512, "seed": 7}),
    "zstd-concat": (
        "zstd", 0, {"max_tokens": 512, "seed": 8, "mode": "pack", "packing": "concat",
                    "seq_len": 48, "attention": "none"}),
    "zstd-best-fit": (
        "zstd", 1, {"max_tokens": 512, "seed": 9, "mode": "pack", "packing": "best_fit",
                    "seq_len": 64, "attention": "none"}),
}  # fmt: skip


def _digest(value: Any) -> str:
    if torch.is_tensor(value):
        head = f"{value.dtype}:{tuple(value.shape)}:".encode()
        return hashlib.sha256(head + value.contiguous().numpy().tobytes()).hexdigest()[:16]
    return repr(value)


def _flat(batch: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in batch.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _flat(value).items()})
        else:
            out[key] = _digest(value)
    return out


def read_epoch(root: str, case: str, kernels: bool) -> list[dict[str, str]]:
    """The digests of every batch of ``case`` read from the caches under ``root``."""
    cache, epoch, options = CASES[case]
    ds = ShardDataset(os.path.join(root, cache), **options)
    ds.kernels = kernels
    ds.set_epoch(epoch)
    return [_flat(batch) for batch in ds]


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the committed caches (a reader writes nothing there, but a test must not
    be able to change what is committed)."""
    root = str(tmp_path_factory.mktemp("recorded") / "epochs")
    shutil.copytree(CACHES, root)
    return root


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "numpy"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_epochs_equal_the_recorded_batches(caches, case, kernels):
    with open(RECORDED, encoding="utf-8") as f:
        recorded = json.load(f)[case]
    got = read_epoch(caches, case, kernels)
    assert len(got) == len(recorded) > 1
    for number, (batch, expected) in enumerate(zip(got, recorded)):
        assert list(batch.items()) == list(expected.items()), f"{case}: batch {number}"


def _build(root: str) -> None:  # pragma: no cover - run by hand (module docstring)
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from conftest import (
        CHATML_TEMPLATE,
        _chat_tokenizer,
        _save_bpe,
        make_conversations,
        make_texts,
        write_records,
    )

    try:
        from shardcache.builder.run import build_cache
    except ImportError:
        from shardcache.build.run import build_cache  # type: ignore[no-redef]
    from shardcache.config import build_options_from_mapping

    work = tempfile.mkdtemp()
    plain = os.path.join(work, "plain")
    chats = os.path.join(work, "chats")
    os.makedirs(plain)
    os.makedirs(chats)
    for f in range(2):
        records = [{"text": t} for t in make_texts(90, seed=70 + f)]
        write_records(os.path.join(plain, f"p{f}.jsonl"), records, "jsonl")
    records = [{"messages": m} for m in make_conversations(90, seed=7)]
    write_records(os.path.join(chats, "c.jsonl"), records, "jsonl")
    tok = _save_bpe(os.path.join(work, "tok"), make_texts(200, seed=1), 300, bos=False)
    chat_tok = _chat_tokenizer(os.path.join(work, "chat-tok"), CHATML_TEMPLATE, False)
    common = {"workers": 1, "shard_size": "4KiB"}
    for name, source, tokenizer, extra in (
        ("plain", plain, tok, {"max_length": 64, "buckets": "8,16,32", "truncation": "split"}),
        (
            "chat",
            chats,
            chat_tok,
            {"max_length": 128, "buckets": "32,64", "chat": True, "truncation": "truncate"},
        ),
        (
            "zstd",
            plain,
            tok,
            {"max_length": 64, "buckets": "8,16,32", "truncation": "split", "compression": "zstd"},
        ),
    ):
        out = os.path.join(root, name)
        shutil.rmtree(out, ignore_errors=True)
        values = {"input": source, "tokenizer": tokenizer, "output": out, **common, **extra}
        build_cache(build_options_from_mapping(values))
        shutil.rmtree(os.path.join(out, "parts"), ignore_errors=True)
    shutil.rmtree(work)


def _record() -> None:  # pragma: no cover - run by hand (module docstring)
    recorded = {case: read_epoch(CACHES, case, kernels=False) for case in sorted(CASES)}
    with open(RECORDED, "w", encoding="utf-8") as f:
        json.dump(recorded, f, indent=0, sort_keys=False)
        f.write("\n")


if __name__ == "__main__":  # pragma: no cover
    if "--build" in sys.argv:
        _build(CACHES)
    if "--record" in sys.argv:
        _record()
