"""The reader's batches and states over a matrix of configurations equal those recorded from it
before the read side became a pipeline of stages (pad / pack best_fit / concat, global plan /
canonical streams, one cache / mixture / schedule, split sides and evaluation passes, pairs,
transforms; each at world size 1 and 3, DataLoader workers 0 and 2).

Per configuration and rank the record holds every batch of one epoch (its keys in order and a
sha256 prefix of each value), ``len``, ``tail_report()``, the live state after half the epoch
and ``state_dict(steps=...)`` for it, and the state after the whole epoch. A resumed reader
loads the *recorded* state (a state saved by the previous version) and must continue with the
recorded rest of the epoch.

The caches are committed (``data/epochs`` for plain, chat and zstd text; ``data/matrix`` for
two preference caches), so the test does not depend on the build pipeline. Regenerate (only
when batch contents are meant to change)::

    python tests/read/test_recorded_matrix.py --build --record   # pair caches too
    python tests/read/test_recorded_matrix.py --record           # digests only
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from shardcache import FIM, Schedule, ShardDataset, Source, Split

# (an evaluation pass over a weighted mixture warns that the weights do not apply: meant here)
pytestmark = pytest.mark.filterwarnings("ignore:.*eval=True reads every document:UserWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
RECORDED = os.path.join(DATA, "recorded_matrix.json")
WORLDS = (1, 3)
WORKERS = (0, 2)


class Reverse:
    """A read-time transform that may lengthen: reversed ids plus 0-2 of the first, by ``rng``."""

    max_growth = 2

    def __call__(self, ids: np.ndarray, mask: np.ndarray | None, rng: np.random.Generator):
        extra = int(rng.integers(0, 3))
        out = np.concatenate([ids[::-1], ids[:extra]])
        if mask is None:
            return out, None
        return out, np.concatenate([mask[::-1], np.zeros(min(extra, len(ids)), dtype=bool)])


def _fim(keep_length: bool = False) -> FIM:
    return FIM(0.5, 5, 6, 7, spm_rate=0.5, keep_length=keep_length)


SPLITS = Split(validation=0.15, test=0.05)
PAIR_SPLITS = Split(validation=0.2)


def _mix(root: str) -> list[Source]:
    return [
        Source(os.path.join(root, "matrix/text_a"), weight=0.7, name="a", max_repetitions=2),
        Source(os.path.join(root, "matrix/text_b"), weight=0.3, name="b", max_repetitions=2),
    ]


def _schedule() -> Schedule:
    points = [
        {"at_tokens": 0, "weights": {"a": 0.8, "b": 0.2}},
        {"at_tokens": 4_000, "weights": {"a": 0.3, "b": 0.7}},
    ]
    return Schedule(points, window_tokens=4_000, total_tokens=12_000)


def _pairs(root: str) -> list[Source]:
    return [
        Source(os.path.join(root, "matrix/pairs_a"), weight=0.5, name="pa", max_repetitions=4),
        Source(os.path.join(root, "matrix/pairs_b"), weight=0.5, name="pb", max_repetitions=4),
    ]


PAD = {"max_tokens": 256}
BEST_FIT = {"max_tokens": 256, "mode": "pack", "packing": "best_fit", "seq_len": 64}
PAIR_PACK = {"max_tokens": 768, "mode": "pack", "packing": "best_fit", "seq_len": 256}
CONCAT = {"max_tokens": 192, "mode": "pack", "packing": "concat", "seq_len": 48}

#: name -> (path of the data under the data root or a sources maker, epoch, keywords maker)
Config = tuple[Callable[[str], Any], int, Callable[[], dict[str, Any]]]


def _at(rel: str) -> Callable[[str], str]:
    return lambda root: os.path.join(root, rel)


CONFIGS: dict[str, Config] = {
    "one-pad-global": (_at("epochs/plain"), 1, lambda: {**PAD, "seed": 1, "streams": 0}),
    "one-pad-streams": (_at("epochs/plain"), 1, lambda: {**PAD, "seed": 2}),
    "one-pad-streams-numpy": (_at("epochs/plain"), 0, lambda: {**PAD, "seed": 3, "kernels": False}),
    "one-pad-wrap-reverse": (
        _at("epochs/plain"), 1,
        lambda: {**PAD, "seed": 4, "tail": "wrap", "transform": Reverse()}),
    "one-bestfit-streams": (
        _at("epochs/plain"), 0, lambda: {**BEST_FIT, "seed": 5, "attention": "varlen"}),
    "one-pad-global-multiple-int64": (
        _at("epochs/zstd"), 1,
        lambda: {**PAD, "seed": 6, "pad_to_multiple_of": 8, "streams": 0, "ids_dtype": "int64"}),
    "one-concat-global": (
        _at("epochs/plain"), 0, lambda: {**CONCAT, "seed": 7, "attention": "mask", "streams": 0}),
    "one-concat-streams-fim": (
        _at("epochs/plain"), 1,
        lambda: {**CONCAT, "seed": 8, "attention": "none", "transform": _fim()}),
    "chat-pad-streams-reverse": (
        _at("epochs/chat"), 0, lambda: {"max_tokens": 512, "seed": 9, "transform": Reverse()}),
    "chat-bestfit-global-fim": (
        _at("epochs/chat"), 1,
        lambda: {**BEST_FIT, "seq_len": 128, "max_tokens": 512, "seed": 10, "attention": "none",
                 "streams": 0, "transform": _fim(keep_length=True)}),
    "chat-concat-streams": (
        _at("epochs/chat"), 0,
        lambda: {**CONCAT, "seq_len": 64, "max_tokens": 256, "seed": 11, "attention": "none"}),
    "split-train-pad-streams": (
        _at("epochs/plain"), 1, lambda: {**PAD, "seed": 12, "split": "train", "splits": SPLITS}),
    "split-validation-eval-pad": (
        _at("epochs/plain"), 0,
        lambda: {**PAD, "split": "validation", "splits": SPLITS, "eval": True}),
    "split-validation-bestfit-global": (
        _at("epochs/zstd"), 0,
        lambda: {**BEST_FIT, "seed": 13, "split": "validation", "splits": SPLITS, "streams": 0,
                 "attention": "none"}),
    "eval-concat-streams": (
        _at("epochs/zstd"), 0, lambda: {**CONCAT, "eval": True, "attention": "none"}),
    "mix-pad-streams": (_mix, 1, lambda: {**PAD, "seed": 14}),
    "mix-bestfit-global-reverse": (
        _mix, 0,
        lambda: {**BEST_FIT, "seq_len": 80, "seed": 15, "streams": 0, "attention": "none",
                 "transform": Reverse()}),
    "mix-concat-streams-tokens": (
        _mix, 1, lambda: {**CONCAT, "seed": 16, "attention": "none", "tokens_per_epoch": 20_000}),
    "mix-split-validation-eval": (
        _mix, 0, lambda: {**PAD, "split": "validation", "splits": SPLITS, "eval": True}),
    "mix-split-train-streams": (
        _mix, 0, lambda: {**PAD, "seed": 17, "split": "train", "splits": SPLITS}),
    "sched-pad-streams": (_mix, 1, lambda: {**PAD, "seed": 18, "schedule": _schedule()}),
    "sched-concat-global": (
        _mix, 2,
        lambda: {**CONCAT, "seed": 19, "streams": 0, "attention": "none",
                 "schedule": _schedule()}),
    "sched-bestfit-streams-fim": (
        _mix, 0,
        lambda: {**BEST_FIT, "seq_len": 80, "seed": 20, "attention": "none",
                 "schedule": _schedule(), "transform": _fim()}),
    "pairs-pad-streams": (_at("matrix/pairs_a"), 1, lambda: {**PAD, "seed": 21}),
    "pairs-pack-global-reverse": (
        _at("matrix/pairs_a"), 0,
        lambda: {**PAIR_PACK, "seed": 22, "streams": 0, "attention": "mask",
                 "transform": Reverse()}),
    "pairs-pack-streams": (
        _at("matrix/pairs_b"), 1, lambda: {**PAIR_PACK, "seed": 23, "attention": "varlen"}),
    "pairs-mix-pad-split-train": (
        _pairs, 0, lambda: {**PAD, "seed": 24, "split": "train", "splits": PAIR_SPLITS}),
    "pairs-mix-pack-streams": (
        _pairs, 1, lambda: {**PAIR_PACK, "seed": 25, "attention": "none"}),
    "pairs-eval-validation": (
        _at("matrix/pairs_a"), 0,
        lambda: {**PAD, "split": "validation", "splits": PAIR_SPLITS, "eval": True}),
}  # fmt: skip


def _digest(value: Any) -> str:
    import hashlib

    if torch.is_tensor(value):
        head = f"{value.dtype}:{tuple(value.shape)}:".encode()
        return hashlib.sha256(head + value.contiguous().numpy().tobytes()).hexdigest()[:16]
    return repr(value)


def _flat(batch: dict[str, Any], prefix: str = "") -> list[list[str]]:
    out: list[list[str]] = []
    for key, value in batch.items():
        if isinstance(value, dict):
            out.extend(_flat(value, f"{prefix}{key}."))
        else:
            out.append([f"{prefix}{key}", _digest(value)])
    return out


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def make(root: str, name: str, rank: int, world: int) -> ShardDataset:
    """The dataset of configuration ``name`` for ``rank`` of ``world``, at its epoch."""
    where, epoch, keywords = CONFIGS[name]
    options = keywords()
    kernels = options.pop("kernels", True)
    ds = ShardDataset(where(root), rank=rank, world_size=world, **options)
    ds.kernels = kernels
    ds.set_epoch(epoch)
    return ds


def record_rank(root: str, name: str, rank: int, world: int) -> dict[str, Any]:
    """What the matrix records of one rank (DataLoader workers 0)."""
    with make(root, name, rank, world) as ds:
        length = len(ds)
        tail = _json(ds.tail_report())
        half = length // 2
        it = iter(ds)
        batches = [_flat(next(it)) for _ in range(half)]
        state_mid = _json(ds.state_dict())
        steps_mid = _json(ds.state_dict(steps=half))
        batches += [_flat(b) for b in it]
        state_end = _json(ds.state_dict())
        schedule = ds.stats().get("schedule")
    return {
        "len": length,
        "tail_report": tail,
        "batches": batches,
        "half": half,
        "state_mid": state_mid,
        "steps_mid": steps_mid,
        "state_end": state_end,
        "schedule_stats": _json(schedule),
    }


def workers_batches(root: str, name: str, rank: int, world: int, workers: int) -> list[Any]:
    """One rank's epoch through a DataLoader with ``workers`` worker processes."""
    with make(root, name, rank, world) as ds:
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        return [_flat(b) for b in loader]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the committed caches (a test must not be able to change what is committed)."""
    root = str(tmp_path_factory.mktemp("matrix"))
    for part in ("epochs", "matrix"):
        shutil.copytree(os.path.join(DATA, part), os.path.join(root, part))
    return root


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    with open(RECORDED, encoding="utf-8") as f:
        return json.load(f)


def test_the_matrix_covers_sixty_configurations(recorded):
    assert len(CONFIGS) * len(WORLDS) * len(WORKERS) >= 60
    assert set(recorded) == {f"{n}/w{w}" for n in CONFIGS for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batches_and_states_equal_the_recorded(root, recorded, name, world):
    expected = recorded[f"{name}/w{world}"]
    total = 0
    for rank in range(world):
        want = expected[rank]
        got = record_rank(root, name, rank, world)
        total += len(got["batches"])
        for key in ("len", "tail_report", "half", "schedule_stats"):
            assert got[key] == want[key], f"{name} rank {rank} of {world}: {key}"
        for number, (a, b) in enumerate(zip(got["batches"], want["batches"])):
            assert a == b, f"{name} rank {rank} of {world}: batch {number}"
        assert len(got["batches"]) == len(want["batches"])
        for key in ("state_mid", "steps_mid", "state_end"):
            # (the run record a state now carries is new: tests/read/test_rewind.py checks it)
            run = got[key].pop("run")
            assert run["cache_digest"] == got[key]["cache_digest"]
            assert got[key] == want[key], f"{name} rank {rank} of {world}: {key}"
    assert total > 0


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_recorded_states_continue_the_recorded_stream(root, recorded, name, world):
    for rank, want in enumerate(recorded[f"{name}/w{world}"]):
        where, _, keywords = CONFIGS[name]
        options = keywords()
        options.pop("kernels", None)
        with ShardDataset(where(root), rank=rank, world_size=world, **options) as ds:
            ds.load_state_dict(want["state_mid"])
            rest = [_flat(b) for b in ds]
        assert rest == want["batches"][want["half"] :], f"{name} rank {rank} of {world}"


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_workers_yield_the_recorded_batches(root, recorded, name, world):
    for rank, want in enumerate(recorded[f"{name}/w{world}"]):
        got = workers_batches(root, name, rank, world, 2)
        assert got == want["batches"], f"{name} rank {rank} of {world}, 2 workers"


def _build() -> None:  # pragma: no cover - run by hand (module docstring)
    import tempfile

    sys.path.insert(0, os.path.join(HERE, ".."))
    from conftest import _save_bpe, make_string_pairs, make_texts, write_records
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    work = tempfile.mkdtemp()
    tok = _save_bpe(os.path.join(work, "tok"), make_texts(200, seed=1), 300, bos=False)
    pairs = {"kind": "preference", "buckets": "16,32"}
    text = {"max_length": 64, "buckets": "8,16,32", "truncation": "split"}
    for name, records, extra in (
        ("pairs_a", make_string_pairs(120, seed=31), pairs),
        ("pairs_b", make_string_pairs(80, seed=32), pairs),
        ("text_a", [{"text": t} for t in make_texts(150, seed=33)], text),
        ("text_b", [{"text": t} for t in make_texts(60, seed=34)], text),
    ):
        source = write_records(os.path.join(work, f"{name}.jsonl"), records, "jsonl")
        out = os.path.join(DATA, "matrix", name)
        shutil.rmtree(out, ignore_errors=True)
        values = {
            "input": source, "tokenizer": tok, "output": out, "workers": 1,
            "shard_size": 4096, **extra,
        }  # fmt: skip
        build_cache(build_options_from_mapping(values))
        shutil.rmtree(os.path.join(out, "parts"), ignore_errors=True)
    shutil.rmtree(work)


def _record() -> None:  # pragma: no cover - run by hand (module docstring)
    recorded = {}
    for name in CONFIGS:
        for world in WORLDS:
            ranks = [record_rank(DATA, name, rank, world) for rank in range(world)]
            for rank in ranks:  # (the states' run record is checked by tests/read/test_rewind.py)
                for key in ("state_mid", "steps_mid", "state_end"):
                    rank[key].pop("run", None)
            recorded[f"{name}/w{world}"] = ranks
            print(name, world, [len(r["batches"]) for r in ranks], flush=True)
    with open(RECORDED, "w", encoding="utf-8") as f:
        json.dump(recorded, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":  # pragma: no cover
    if "--build" in sys.argv:
        _build()
    if "--record" in sys.argv:
        _record()
