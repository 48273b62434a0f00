"""Leaving documents out from a position on: never read after it, nothing before it changed.

A reference run without exclusion is read rank by rank over two epochs. A state taken at a
point of it is loaded with ``exclude=`` documents read after the point (in that epoch and the
next; every document of one batch among them, which is then read as padding) and one read
before it; the resumed stream must be the reference's with exactly those documents' segments
taken out, and a rewind of the excluded run must give the reference's batches before the point.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import assert_batches_equal
from shardcache import FIM, ShardDataset, Source, Split
from shardcache.cli import main
from shardcache.errors import ConfigError, StateError
from shardcache.read.exclusion import read_documents, recorded_documents, without_units
from shardcache.read.plan.plan_arrays import EpochPlan
from shardcache.read.rewind import Rewinder, exclude_state, rewind
from shardcache.store.cache import open_cache

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
TEXT = os.path.join(DATA, "matrix", "text_a")
POINT = 3  # batches every rank read before the exclusion
MODES: dict[str, dict[str, Any]] = {
    "pad": {},
    "pack": {"mode": "pack", "seq_len": 64, "attention": "varlen"},
}


def _open(world: int, rank: int, mode: str = "pad") -> ShardDataset:
    return ShardDataset(TEXT, max_tokens=256, rank=rank, world_size=world, **MODES[mode])


def _stream(ds: ShardDataset, workers: int = 0) -> Iterator[dict[str, Any]]:
    """A rank's batches through the epochs, as a training loop reads them (set_epoch each)."""
    while True:
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        yield from loader
        ds.set_epoch(ds.epoch + 1)


def _read(ds: ShardDataset, count: int, workers: int = 0) -> list[dict[str, Any]]:
    stream = _stream(ds, workers)
    return [next(stream) for _ in range(count)]


def _segments(batch: dict[str, Any]) -> list[tuple[int, int, list[int], list[int]]]:
    """``(source, sample id, ids, labels)`` of every real segment of a batch, in order."""
    meta = batch["meta"]
    samples = meta["sample_ids"].tolist()
    sources = meta["source_ids"].tolist() if "source_ids" in meta else [0] * len(samples)
    ids, labels = batch["input_ids"], batch["labels"]
    if "cu_seqlens" in meta:  # packed: segments of the flattened rows
        cu = meta["cu_seqlens"].tolist()
        flat_ids, flat_labels = ids.reshape(-1), labels.reshape(-1)
        spans = [(flat_ids[a:b], flat_labels[a:b]) for a, b in itertools.pairwise(cu)]
    else:  # pad: a sequence a row, its attended tokens
        real = batch["attention_mask"].bool()
        spans = [(ids[k][real[k]], labels[k][real[k]]) for k in range(len(samples))]
    return [
        (int(s), int(k), i.tolist(), lab.tolist())
        for s, k, (i, lab) in zip(sources, samples, spans)
        if k >= 0
    ]


def _names(root: str | list[str], ids: list[tuple[int, int]]) -> list[str]:
    """``FILE:RECORD`` of (source, sample id) pairs."""
    paths = [root] if isinstance(root, str) else root
    caches = [open_cache(p) for p in paths]
    try:
        out = []
        for s, k in ids:
            where = caches[s].lookup(k)
            out.append(f"{where.source}:{where.record}")
        return list(dict.fromkeys(out))
    finally:
        for cache in caches:
            cache.close()


_REFERENCE: dict[tuple[int, str], tuple[int, list[list[dict[str, Any]]]]] = {}


def _reference(world: int, mode: str) -> tuple[int, list[list[dict[str, Any]]]]:
    """Every rank's batches of two epochs without exclusion (and the batches per epoch)."""
    key = (world, mode)
    if key not in _REFERENCE:
        runs = []
        for rank in range(world):
            with _open(world, rank, mode) as ds:
                per_epoch = len(ds)
                runs.append(_read(ds, 2 * per_epoch))
        _REFERENCE[key] = (per_epoch, runs)
    return _REFERENCE[key]


def _point_state(world: int, mode: str) -> dict[str, Any]:
    with _open(world, 0, mode) as ds:
        return json.loads(json.dumps(ds.state_dict(steps=POINT)))


def _chosen(per_epoch: int, runs: list[list[dict[str, Any]]]) -> list[tuple[int, int]]:
    """Every document of rank 0's first batch after the point, one of the last rank's next
    batch, one of rank 0's in the next epoch, and one read before the point."""
    whole = [(s, k) for s, k, _, _ in _segments(runs[0][POINT])]
    later = _segments(runs[-1][POINT + 1])[0][:2]
    next_epoch = _segments(runs[0][per_epoch + 2])[-1][:2]
    before = _segments(runs[-1][0])[0][:2]
    return [*whole, later, next_epoch, before]


def _check_stream(
    got: list[dict[str, Any]], want: list[dict[str, Any]], excluded: set[tuple[int, int]]
) -> int:
    """``got`` is ``want`` without the excluded segments; returns the batches that lost some."""
    changed = 0
    assert len(got) == len(want)
    for a, b in zip(got, want):
        read = {(s, k) for s, k in zip(_sources(a), a["meta"]["sample_ids"].tolist())}
        assert not read & excluded
        kept = [seg for seg in _segments(b) if (seg[0], seg[1]) not in excluded]
        assert _segments(a) == kept
        if len(kept) == len(_segments(b)):
            assert_batches_equal(a, b)
            continue
        changed += 1
        if kept:
            assert "filler" not in a["meta"]
        else:  # every document left out: the batch's shape, as padding
            assert bool(a["meta"]["filler"]) and a["input_ids"].shape == b["input_ids"].shape
            assert (a["labels"] == -100).all() and (a["meta"]["sample_ids"] == -1).all()
    return changed


def _sources(batch: dict[str, Any]) -> list[int]:
    meta = batch["meta"]
    n = len(meta["sample_ids"])
    return meta["source_ids"].tolist() if "source_ids" in meta else [0] * n


@pytest.mark.parametrize(
    "world,workers,mode", [(2, 0, "pad"), (2, 2, "pad"), (3, 0, "pad"), (3, 2, "pad"),
                           (3, 2, "pack")],
)  # fmt: skip
def test_excluded_documents_never_appear_after_the_point(world, workers, mode):
    per_epoch, runs = _reference(world, mode)
    chosen = _chosen(per_epoch, runs)
    names = _names(TEXT, chosen)
    excluded = _all_pieces(names)
    state = _point_state(world, mode)
    changed = 0
    for rank in range(world):
        with _open(world, rank, mode) as ds:
            ds.load_state_dict(state, exclude=names)
            got = _read(ds, 2 * per_epoch - POINT, workers)
            changed += _check_stream(got, runs[rank][POINT:], excluded)
            if workers == 0:  # (the main process read them)
                assert ds.stats()["excluded_segments"] > 0
            (info,) = ds.stats()["exclusions"]
            assert (info["epoch"], info["consumed"]) == (0, POINT * world)
            assert info["documents"] == names
            after = ds.state_dict()
        # nothing before the point changed: the excluded run's rewind gives the reference's
        with Rewinder(after) as rewinder:
            for step in range(POINT):
                (old,) = rewinder.step(step, rank=rank)
                assert_batches_equal(old.batch, runs[rank][step])
            for step in (POINT, per_epoch + 2):
                (new,) = rewinder.step(step, rank=rank)
                assert_batches_equal(new.batch, got[step - POINT])
    assert changed >= 4  # (the whole batch, the later one, the next epoch's, the earlier doc's)


def _all_pieces(names: list[str], paths: list[str] | None = None) -> set[tuple[int, int]]:
    """(source, sample id) of every piece of the named documents in every source."""
    from shardcache.store.show import document_pieces

    out = set()
    for s, path in enumerate(paths or [TEXT]):
        cache = open_cache(path)
        try:
            for name in names:
                file, _, record = name.rpartition(":")
                try:
                    pieces = document_pieces(cache, file, int(record))
                except ConfigError:  # (a file of another source)
                    continue
                out |= {(s, int(k)) for k in pieces}
        finally:
            cache.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_state_after_the_point_resumes_the_same_stream(world):
    per_epoch, runs = _reference(world, "pad")
    names = _names(TEXT, _chosen(per_epoch, runs))
    state = _point_state(world, "pad")
    for rank in range(world):
        with _open(world, rank) as ds:
            ds.load_state_dict(state, exclude=names)
            whole = _read(ds, per_epoch)
        with _open(world, rank) as ds:
            ds.load_state_dict(state, exclude=names)
            later = json.loads(json.dumps(ds.state_dict(steps=2)))
        assert recorded_documents(later) == names
        with _open(world, rank) as resumed:
            resumed.load_state_dict(later, exclude=names)
            for got, want in zip(_read(resumed, per_epoch - 2, workers=2), whole[2:]):
                assert_batches_equal(got, want)
        with _open(world, rank) as bare, pytest.raises(StateError, match="exclude= does not"):
            bare.load_state_dict(later)  # (a reader that would read them again)
        with _open(world, rank) as part, pytest.raises(StateError, match=names[-1]):
            part.load_state_dict(later, exclude=names[:-1])


def test_resumed_at_another_world_size():
    per_epoch, runs = _reference(2, "pad")
    names = _names(TEXT, _chosen(per_epoch, runs))
    state = _point_state(2, "pad")  # (taken at W 2, resumed at W 3)
    for rank in range(3):
        with _open(3, rank) as ds, _open(3, rank) as reference:
            ds.load_state_dict(state, exclude=names)
            reference.load_state_dict(state)
            count = len(ds) + ds.batches_per_rank(1)  # (the rest of this epoch, the next)
            got, want = _read(ds, count, workers=2), _read(reference, count)
        assert _check_stream(got, want, _all_pieces(names)) >= 1


def test_find_document_gives_no_read_after_the_point():
    per_epoch, runs = _reference(2, "pad")
    names = _names(TEXT, _chosen(per_epoch, runs))
    state = _point_state(2, "pad")
    with _open(2, 0) as ds:
        ds.load_state_dict(state, exclude=names)
        after = ds.state_dict()
    with Rewinder(state) as plain, Rewinder(after) as excluded:
        for name in names:
            file, _, record = name.rpartition(":")
            before = plain.find_document(file, int(record), epochs=2)
            kept = excluded.find_document(file, int(record), epochs=2)
            assert kept == [r for r in before if (r["epoch"], r["step"]) < (0, POINT)]
            assert len(kept) < len(before)


def test_refusals():
    state = _point_state(2, "pad")
    name = _names(TEXT, [(0, 5)])[0]
    with _open(2, 0) as ds:
        ds.load_state_dict(state)
        with pytest.raises(ConfigError, match=r"before the reader's position \(epoch 0, global"):
            ds.exclude([name], at=(0, POINT * 2 - 1))
        with pytest.raises(ConfigError, match="no source"):
            ds.load_state_dict(state, exclude=["missing.jsonl:0"])
        with pytest.raises(ConfigError, match="expected a document as 'FILE:RECORD'"):
            ds.load_state_dict(state, exclude=["no-record"])
        with pytest.raises(ConfigError, match="expected a list of documents"):
            ds.load_state_dict(state, exclude=name)
        worker = {**state, "worker": {"id": 1, "num_workers": 2, "world_size": 2,
                                      "start": 0, "yielded": POINT}}  # fmt: skip
        with pytest.raises(ConfigError, match="one DataLoader worker's state"):
            ds.load_state_dict(worker, exclude=[name])
        with pytest.raises(ConfigError, match="expected \\(epoch, consumed\\)"):
            ds.exclude([name], at=(0, -1))
        later = ds.exclude([name], at=(1, 0))  # (a later position: allowed)
        assert (later.epoch, later.consumed) == (1, 0)


def _mixture(root: str, rank: int, world: int) -> ShardDataset:
    sources = [
        Source(os.path.join(root, "text_a"), weight=0.7, name="a", max_repetitions=2),
        Source(os.path.join(root, "text_b"), weight=0.3, name="b", max_repetitions=2),
    ]
    return ShardDataset(
        sources, max_tokens=256, rank=rank, world_size=world, split="train",
        splits=Split(validation=0.15), transform=FIM(0.5, 5, 6, 7, spm_rate=0.5),
    )  # fmt: skip


def test_a_mixture_with_a_split_and_a_transform():
    root, world = os.path.join(DATA, "matrix"), 2
    runs = []
    for rank in range(world):
        with _mixture(root, rank, world) as ds:
            per_epoch = len(ds)
            runs.append(_read(ds, 2 * per_epoch))
    after_point = [seg[:2] for batch in runs[0][POINT:] + runs[1][per_epoch:] for seg in
                   _segments(batch)]  # fmt: skip
    # the first two documents of each source read after the point
    chosen = [doc for s in (0, 1) for doc in [d for d in after_point if d[0] == s][:2]]
    assert {s for s, _ in chosen} == {0, 1}  # (both sources)
    paths = [os.path.join(root, "text_a"), os.path.join(root, "text_b")]
    names = _names(paths, chosen)
    with _mixture(root, 0, world) as ds:
        state = json.loads(json.dumps(ds.state_dict(steps=POINT)))
    excluded = _all_pieces(names, paths)
    assert len(excluded) > len(set(chosen))  # (a document cut in pieces: all of them go)
    for rank in range(world):
        with _mixture(root, rank, world) as ds:
            ds.load_state_dict(state, exclude=names)
            got = _read(ds, 2 * per_epoch - POINT, workers=2)
            after = ds.state_dict()
        assert _check_stream(got, runs[rank][POINT:], excluded) >= 1
        # a rewind of a step after the point names none of the excluded documents
        seen = []  # (a batch of excluded documents only is all padding: its rows are none)
        for step in (POINT, per_epoch):
            rows = [r for b in rewind(after, step, rank=rank) for r in b["rows"] if r["sample_id"]
                    is not None]  # fmt: skip
            assert not {f"{r['file']}:{r['record']}" for r in rows} & set(names)
            seen += rows
        assert seen
        with Rewinder(after) as rewinder:
            (old,) = rewinder.step(POINT - 1, rank=rank)
            assert_batches_equal(old.batch, runs[rank][POINT - 1])


def test_cli_rewind_exclude(tmp_path):
    per_epoch, runs = _reference(2, "pad")
    names = _names(TEXT, _chosen(per_epoch, runs))
    state_file = tmp_path / "state.json"
    state = _point_state(2, "pad")
    state_file.write_text(json.dumps(state))
    runner = CliRunner()
    out = tmp_path / "excluded.json"
    done = runner.invoke(main, ["rewind", str(state_file), "--exclude", ",".join(names[:2]),
                                "--state", str(state_file), "--out", str(out)])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert json.loads(out.read_text()) == exclude_state(state, names[:2])
    listed = tmp_path / "documents.txt"
    listed.write_text("# left out after the spike\n" + "\n".join(names) + "\n")
    assert [f"{f}:{r}" for f, r in read_documents(listed)] == names
    again = tmp_path / "again.json"
    done = runner.invoke(main, ["rewind", str(out), "--exclude-file", str(listed), "--state",
                                str(out), "--out", str(again)])  # fmt: skip
    assert done.exit_code == 0, done.output
    new = json.loads(again.read_text())
    assert recorded_documents(new) == names
    # the first exclusion's two, then the others from the same position
    assert [len(e["documents"]) for e in new["run"]["exclusions"]] == [2, len(names) - 2]
    with _open(2, 1) as ds:
        ds.load_state_dict(new, exclude=names)
        assert not {(0, k) for k in next(iter(ds))["meta"]["sample_ids"].tolist()} & (
            _all_pieces(names)
        )
    bad = runner.invoke(main, ["rewind", str(state_file), "--exclude", names[0], "--out",
                               str(tmp_path / "x.json")])  # fmt: skip
    assert bad.exit_code == 2 and "--state" in bad.output
    both = runner.invoke(main, ["rewind", str(state_file), "--exclude", names[0], "--skip",
                                "1:2", "--state", str(state_file), "--out", str(out)])  # fmt: skip
    assert both.exit_code == 2 and "exactly one" in both.output
    malformed = runner.invoke(main, ["rewind", str(state_file), "--exclude", "no-record",
                                     "--state", str(state_file), "--out", str(out)])  # fmt: skip
    assert malformed.exit_code == 2 and "FILE:RECORD" in malformed.output


def test_with_a_skip_the_exclusion_starts_where_the_skip_lands():
    per_epoch, runs = _reference(2, "pad")
    names = _names(TEXT, _chosen(per_epoch, runs))
    state = _point_state(2, "pad")
    with _open(2, 1) as ds:
        ds.load_state_dict(state, skip_steps=[(POINT, POINT + 2)], exclude=names)
        (info,) = ds.stats()["exclusions"]
        assert (info["epoch"], info["consumed"]) == (0, (POINT + 2) * 2)
        got = _read(ds, per_epoch - POINT - 2)
    _check_stream(got, runs[1][POINT + 2 : per_epoch], _all_pieces(names))


@pytest.mark.parametrize("rows", [False, True])
def test_without_units_keeps_every_other_segment_in_its_row(rows):
    rng = np.random.default_rng(7)
    for _ in range(50):
        count = int(rng.integers(1, 12))
        ids = rng.integers(0, 20, count).astype(np.int64)
        bounds = np.unique(np.concatenate([[0, count], rng.integers(0, count + 1, 3)]))
        plan = EpochPlan(
            batch_offsets=np.array([0, 2, 2 + count], dtype=np.int64),
            sample_ids=np.concatenate([[98, 99], ids]),
            row_offsets=np.concatenate([[0], bounds + 2]) if rows else None,
            seg_starts=np.arange(count + 2, dtype=np.int64) * 3,
            repeats=np.arange(count + 2, dtype=np.int64) % 2,
        )
        units = np.unique(rng.integers(0, 20, 4)).astype(np.int64)
        cut = without_units(plan, 1, units)
        held = np.isin(ids, units)
        if not held.any():
            assert cut is None
            continue
        assert cut is not None and len(cut) == 1
        assert cut.sample_ids.tolist() == ids[~held].tolist()
        assert cut.seg_starts.tolist() == (np.arange(2, count + 2) * 3)[~held].tolist()
        assert cut.repeats.tolist() == (np.arange(2, count + 2) % 2)[~held].tolist()
        if rows:  # every row is still there, with its own kept segments
            got = [cut.sample_ids[a:b].tolist() for a, b in itertools.pairwise(cut.row_offsets)]
            want = [ids[a:b][~held[a:b]].tolist() for a, b in itertools.pairwise(bounds)]
            assert got == want
        else:
            assert cut.row_offsets is None
