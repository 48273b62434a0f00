"""Rewind: a run record recomputes the exact batches of any step, and skipping steps on resume.

A run of a mixture with a split and a transform is simulated rank by rank (rank=/world_size=)
through DataLoaders with 2 workers over several epochs, every micro-batch logged by step; the
record alone must give the same batches back, reading only the shards they use.
"""

from __future__ import annotations

import json
import os
import shutil
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
from shardcache.read.plan import streams as streams_module
from shardcache.read.rewind import Rewinder, rewind, skip_state, write_run_record
from shardcache.read.run_record import RunRecord, read_run_record
from shardcache.store.cache import ShardCache

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
W, A = 2, 2


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the committed caches."""
    root = str(tmp_path_factory.mktemp("rewind"))
    shutil.copytree(os.path.join(DATA, "matrix"), os.path.join(root, "matrix"))
    return root


def _sources(root: str) -> list[Source]:
    return [
        Source(os.path.join(root, "matrix/text_a"), weight=0.7, name="a", max_repetitions=2),
        Source(os.path.join(root, "matrix/text_b"), weight=0.3, name="b", max_repetitions=2),
    ]


def _make(root: str, rank: int, world: int) -> ShardDataset:
    return ShardDataset(
        _sources(root), max_tokens=256, rank=rank, world_size=world, split="train",
        splits=Split(validation=0.15), transform=FIM(0.5, 5, 6, 7, spm_rate=0.5),
    )  # fmt: skip


def _stream(ds: ShardDataset, workers: int = 0) -> Iterator[dict[str, Any]]:
    """A rank's batches through the epochs, as a training loop reads them (set_epoch each)."""
    while True:
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        yield from loader
        ds.set_epoch(ds.epoch + 1)


@pytest.fixture(scope="module")
def logged(root: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A run of W ranks, accumulation A, 2 DataLoader workers, 3 epochs: batches by step."""
    folder = str(tmp_path_factory.mktemp("ckpt"))
    log: dict[tuple[int, int, int], dict[str, Any]] = {}
    for rank in range(W):
        with _make(root, rank, W) as ds:
            if rank == 0:
                write_run_record(folder, ds, grad_accum=A)
            per_epoch = len(ds)
            stream = _stream(ds, workers=2)
            for n in range(3 * per_epoch):
                log[(n // A, rank, n % A)] = next(stream)
    return folder, log


def test_the_record_is_small_readable_json(logged):
    folder, _ = logged
    path = os.path.join(folder, "shardcache-run.json")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    data = json.loads(text)
    assert len(text) < 4096
    assert (data["world_size"], data["grad_accum"]) == (W, A)
    assert [s["name"] for s in data["dataset"]["sources"]] == ["a", "b"]
    assert all(len(s["digest"]) == 64 for s in data["dataset"]["sources"])
    assert data["dataset"]["transform"][0]["class"] == "FIM"
    assert data["dataset"]["split"] == "train" and data["plan"]["max_tokens"] == 256
    assert RunRecord.from_json(data).to_json() == data


def test_rewind_reproduces_every_logged_step(logged):
    folder, log = logged
    steps = sorted({step for step, _, _ in log})
    assert len(steps) > 60  # (three epochs: the steps cross epoch boundaries)
    seen = 0
    with Rewinder(folder) as rewinder:
        for step in steps:
            for got in rewinder.step(step):
                want = log.get((step, got.rank, got.micro))
                if want is None:  # (the log stops inside the last step)
                    continue
                assert_batches_equal(got.batch, want)
                seen += 1
    assert seen == len(log)


def test_one_rank_and_micro_batch_as_json(logged):
    folder, log = logged
    (got,) = rewind(folder, 40, rank=1, micro=1)
    want = log[(40, 1, 1)]
    assert (got["step"], got["rank"], got["micro"]) == (40, 1, 1)
    real = [row for row in got["rows"] if row["sample_id"] is not None]
    assert [row["sample_id"] for row in real] == want["meta"]["sample_ids"].tolist()
    assert {row["source"] for row in real} <= {"a", "b"}
    assert all(row["split"] == "train" and row["transform"] == ["FIM"] for row in real)
    for row in real:
        labels = want["labels"][row["row"], row["start"] : row["end"]]
        assert row["trainable"] == int((labels != -100).sum())
        assert row["file"].endswith(".jsonl") and row["record"] >= 0


def test_rewind_reads_only_the_shards_of_the_batch(logged, monkeypatch):
    folder, _ = logged
    opened: list[str] = []
    original = ShardCache.get

    def get(self: ShardCache, index: int) -> Any:
        opened.append(self.shards[index]["sha256"])
        return original(self, index)

    monkeypatch.setattr(ShardCache, "get", get)
    with Rewinder(folder) as rewinder:
        opened.clear()  # (opening a split reads its documents' keys: the selection, not a batch)
        (got,) = rewinder.step(70, rank=0, micro=1)  # (an epoch past the first)
        read = set(opened)
        meta = got.batch["meta"]
        used = set()
        for source, sample in zip(meta["source_ids"].tolist(), meta["sample_ids"].tolist()):
            cache = rewinder.cache(source)
            shard = int(np.searchsorted(cache.shard_starts, sample, side="right")) - 1
            used.add(cache.shards[shard]["sha256"])
    assert read and read <= used


def test_a_step_of_whole_stream_rounds_plans_only_its_stream(root, logged, monkeypatch):
    # a state's record knows each epoch's stream length: one batch is its stream's planning
    _, log = logged
    state = _state_at(root, 70)
    record = RunRecord.from_json(state)
    assert set(record.epoch_rounds) == set(record.epoch_batches) == {0, 1, 2}
    streams = record.plan["streams"]
    assert all(record.epoch_batches[e] == streams * m for e, m in record.epoch_rounds.items())
    counted: list[list[int] | None] = []
    original = streams_module.count_batches

    def count_batches(layout: Any, options: Any, chosen: list[int] | None = None) -> Any:
        counted.append(chosen)
        return original(layout, options, chosen)

    monkeypatch.setattr(streams_module, "count_batches", count_batches)
    steps = [0, 33, 69]
    with Rewinder(state) as rewinder:
        fast = {step: rewinder.step(step) for step in steps}
    assert counted and all(chosen is not None and len(chosen) == 1 for chosen in counted)
    del state["run"]["epoch_rounds"]  # (a record without them plans whole epochs)
    with Rewinder(state) as rewinder:
        for step in steps:
            for got, planned in zip(fast[step], rewinder.step(step), strict=True):
                assert (got.epoch, got.index) == (planned.epoch, planned.index)
                assert_batches_equal(got.batch, planned.batch)
                assert_batches_equal(got.batch, log[(step, got.rank, got.micro)])


def test_find_document_gives_the_steps_that_read_it(logged):
    folder, log = logged
    with Rewinder(folder) as rewinder:
        (got,) = rewinder.step(10, rank=1, micro=0)
        row = next(r for r in rewinder.rows(got) if r["sample_id"] is not None)
        found = rewinder.find_document(row["file"], row["record"], epochs=3)
    assert any((f["step"], f["rank"], f["micro"]) == (10, 1, 0) for f in found)
    for f in found:
        batch = log.get((f["step"], f["rank"], f["micro"]))
        if batch is not None:
            assert f["sample_id"] in batch["meta"]["sample_ids"].tolist()
    with Rewinder(folder) as rewinder, pytest.raises(ConfigError, match="no source"):
        rewinder.find_document("missing.jsonl", 0)


def _state_at(root: str, step: int) -> dict[str, Any]:
    """Rank 0's state of the W-rank run once ``step`` steps were read (live, across epochs)."""
    with _make(root, 0, W) as ds:
        ds.grad_accum = A
        stream = _stream(ds)
        for _ in range(step * A):
            next(stream)
        return json.loads(json.dumps(ds.state_dict()))


@pytest.mark.parametrize("first,end", [(100, 150), (30, 47)])
def test_skip_steps_continue_as_the_uninterrupted_run(root, first, end):
    at = _state_at(root, first)
    uninterrupted = _state_at(root, end)
    for rank in range(3):  # resumed at W 2 -> 3
        with _make(root, rank, 3) as skipped, _make(root, rank, 3) as reference:
            skipped.load_state_dict(at, skip_steps=[(first, end)])
            reference.load_state_dict(uninterrupted)
            assert len(skipped) == len(reference)
            a, b = _stream(skipped), _stream(reference)
            for _ in range(12):
                assert_batches_equal(next(a), next(b))
            (info,) = skipped.stats()["skipped_steps"]
            assert (info["first"], info["end"], info["at_step"]) == (first, end, first)
            state = skipped.state_dict()
    record = RunRecord.from_json(state)
    assert [s.world_size for s in record.segments] == [W, 3]
    assert record.segments[-1].step == first and record.skipped[0].end == end


def test_rewind_after_a_skip_gives_the_resumed_run_batches(root):
    at = _state_at(root, 20)
    with _make(root, 1, 3) as ds:
        ds.load_state_dict(at, skip_steps=[(20, 26)])
        state = ds.state_dict()
        stream = _stream(ds)
        read = [next(stream) for _ in range(2 * A)]
    with Rewinder(state) as rewinder:
        for n, want in enumerate(read):
            (got,) = rewinder.step(20 + n // A, rank=1, micro=n % A)
            assert_batches_equal(got.batch, want)


def test_skip_refusals(root):
    at = _state_at(root, 10)
    with _make(root, 0, W) as ds:
        with pytest.raises(ConfigError, match="starts after the state's step 10"):
            ds.load_state_dict(at, skip_steps=[(12, 20)])
        with pytest.raises(ConfigError, match="expected a pair"):
            ds.load_state_dict(at, skip_steps=[(20, 12)])
        with pytest.raises(ConfigError, match="overlap"):
            ds.load_state_dict(at, skip_steps=[(5, 15), (10, 20)])
        ds.load_state_dict(at, skip_steps=[(2, 5)])  # (before the state: nothing to skip)
        assert "skipped_steps" not in ds.stats()


def test_a_state_without_a_run_record_still_loads(root):
    at = _state_at(root, 10)
    del at["run"]
    with _make(root, 0, W) as ds, _make(root, 0, W) as reference:
        ds.load_state_dict(at)
        reference.load_state_dict(_state_at(root, 10))
        assert_batches_equal(next(iter(ds)), next(iter(reference)))
        # its steps count from its own position
        assert ds.run_record().segments[-1].step == 0


def test_rewind_refuses_changed_data(logged, tmp_path):
    folder, _ = logged
    data = read_run_record(folder).to_json()
    data["cache_digest"] = "0" * 64
    with pytest.raises(StateError, match="changed since"):
        Rewinder(data)
    with pytest.raises(StateError, match="no file"):
        read_run_record(tmp_path / "nothing")


def test_cli_rewind(logged, root, tmp_path):
    folder, log = logged
    runner = CliRunner()
    done = runner.invoke(main, ["rewind", folder, "--step", "5", "--rank", "0", "--json"])
    assert done.exit_code == 0, done.output
    batches = json.loads(done.stdout)["batches"]
    assert [(b["rank"], b["micro"]) for b in batches] == [(0, 0), (0, 1)]
    for b in batches:
        want = log[(5, 0, b["micro"])]["meta"]["sample_ids"].tolist()
        assert [r["sample_id"] for r in b["rows"] if r["sample_id"] is not None] == want
    text = runner.invoke(main, ["rewind", folder, "--step", "5", "--rank", "0", "--no-color"])
    assert text.exit_code == 0 and "step 5 rank 0 micro 1" in text.stdout
    out = tmp_path / "steps.jsonl"
    done = runner.invoke(main, ["rewind", folder, "--steps", "3:5", "--out", str(out)])
    assert done.exit_code == 0, done.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["step"], x["rank"], x["micro"]) for x in lines] == [
        (s, r, m) for s in (3, 4) for r in range(W) for m in range(A)
    ]
    assert "ids" not in lines[0]["rows"][0]
    state = tmp_path / "state.json"
    state.write_text(json.dumps(_state_at(root, 30)))
    new = tmp_path / "skipped.json"
    done = runner.invoke(main, ["rewind", folder, "--skip", "30:40", "--state", str(state),
                                "--world-size", "3", "--out", str(new)])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert json.loads(new.read_text()) == skip_state(
        json.loads(state.read_text()), [(30, 40)], world_size=3
    )
    assert runner.invoke(main, ["rewind", folder]).exit_code == 2
    assert runner.invoke(main, ["rewind", folder, "--step", "1", "--micro", "7"]).exit_code == 2
    bad = runner.invoke(main, ["rewind", str(tmp_path / "none"), "--step", "1"])
    assert bad.exit_code == 1 and "no file" in bad.output
