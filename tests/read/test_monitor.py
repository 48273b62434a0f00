"""StallMonitor: per-step data-loading figures that add up, travel from workers, reach
TensorBoard, and show the skew between ranks."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch.utils.data import DataLoader

import shardcache
from shardcache import ConfigError, ShardDataset, StallMonitor

SLOW_S = 0.002  # per sequence, in the (fake slow) gather stage


def slow_transform(ids, mask, rng):
    time.sleep(SLOW_S)
    return ids, mask


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="16,32")


def run_steps(monitor, batches, steps, compute_s=0.0):
    out = []
    for batch in monitor.wrap(batches):
        time.sleep(compute_s)
        out.append((batch, monitor.step()))
        if len(out) == steps:
            break
    return out


def test_the_figures_add_up_to_the_step_with_a_slow_stage(cache_dir):
    ds = ShardDataset(cache_dir, 128, seed=1, transform=slow_transform)
    monitor = StallMonitor(ranks=False)
    began = time.perf_counter()
    steps = run_steps(monitor, ds, 8, compute_s=0.01)
    wall = time.perf_counter() - began
    figures = [f for _, f in steps]
    total = {k: sum(f[k] for f in figures) for k in figures[0]}
    stages = total["plan_s"] + total["fetch_s"] + total["gather_s"] + total["collate_s"]
    # in-process, the wait for next() is the reader's stages, and the step its wait + compute
    assert stages == pytest.approx(total["data_loading_s"], rel=0.05)
    assert total["step_s"] == pytest.approx(wall, rel=0.05)
    assert total["data_loading_s"] + total["compute_s"] == pytest.approx(total["step_s"])
    assert total["gather_s"] > total["collate_s"]  # the slow stage is named
    for f in figures:
        assert f["batches"] == 1 and f["wait_copy_s"] == 0.0
        assert f["wait_reader_s"] == f["data_loading_s"]
        assert f["data_loading_pct"] == pytest.approx(100 * f["data_loading_s"] / f["step_s"])


def test_the_first_wait_includes_planning_the_pass(cache_dir, monkeypatch):
    """ShardDataset plans its pass in ``iter()``, before the first ``next()``: a slow plan is
    data loading (the step waits for it), not compute."""
    ds = ShardDataset(cache_dir, 128, seed=1)
    plan = ds.plan

    def slow_plan():
        time.sleep(0.2)
        return plan()

    monkeypatch.setattr(ds, "plan", slow_plan)
    monitor = StallMonitor(ranks=False)
    (_, first), *_ = run_steps(monitor, ds, 2)
    assert first["plan_s"] >= 0.2  # a sleep lasts at least its length
    assert first["data_loading_s"] >= first["plan_s"]
    assert first["compute_s"] < first["plan_s"]


def test_stage_times_travel_from_dataloader_workers(cache_dir):
    ds = ShardDataset(cache_dir, 128, seed=1, transform=slow_transform)
    monitor = StallMonitor(ranks=False)
    steps = run_steps(monitor, DataLoader(ds, batch_size=None, num_workers=1, timeout=120), 4)
    for batch, figures in steps:
        stages = batch["meta"]["stage_s"]
        assert set(stages) == {"plan_s", "fetch_s", "gather_s", "collate_s"}
        n = len(batch["meta"]["sample_ids"])
        assert stages["gather_s"] >= n * SLOW_S  # a sleep lasts at least its length
        assert figures["gather_s"] == stages["gather_s"]


def test_an_unmonitored_batch_carries_no_stage_times(cache_dir):
    batch = next(iter(ShardDataset(cache_dir, 128, seed=1)))
    assert "stage_s" not in batch["meta"]


def test_the_loader_and_its_prefetcher_are_found(cache_dir):
    with shardcache.loader(cache_dir, 128, num_workers=0, device="cpu", seed=1) as dl:
        monitor = StallMonitor(ranks=False)
        steps = run_steps(monitor, dl, 3)
        assert dl.dataset.time_stages and monitor._prefetcher is dl.prefetcher
    for batch, figures in steps:
        assert "stage_s" in batch["meta"]
        assert {"pin_s", "copy_s"} <= set(figures)


def test_figures_are_written_to_tensorboard(cache_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    monitor = StallMonitor(writer, prefix="data/", ranks=False)
    figures = [f for _, f in run_steps(monitor, ShardDataset(cache_dir, 128, seed=1), 5)]
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"data/data_loading_s", "data/data_loading_pct", "data/wait_reader_s"} <= set(tags)
    for name in ("data_loading_s", "data_loading_pct", "gather_s"):
        scalars = events.Scalars(f"data/{name}")
        assert [s.step for s in scalars] == list(range(5))
        assert [s.value for s in scalars] == pytest.approx([f[name] for f in figures], rel=1e-6)


def test_a_writer_without_add_scalar_is_refused():
    with pytest.raises(ConfigError, match="add_scalar"):
        StallMonitor(writer=object())


def _slow_batches(rank: int):
    for k in range(4):
        if rank == 1:
            time.sleep(0.02)
        yield {"input_ids": torch.zeros(2, 4), "meta": {"k": k}}


def _skew_worker(rank, init, out):
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        monitor = StallMonitor()
        figures = [f for _, f in run_steps(monitor, _slow_batches(rank), 4)]
        with open(out + str(rank), "w") as f:
            json.dump(figures, f)
    finally:
        torch.distributed.destroy_process_group()


def test_rank_skew_under_two_gloo_ranks(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "figures")
    torch.multiprocessing.spawn(_skew_worker, args=(init, out), nprocs=2)
    ranks = []
    for rank in range(2):
        with open(out + str(rank)) as f:
            ranks.append(json.load(f))
    for step in range(4):
        fast, slow = ranks[0][step], ranks[1][step]
        assert fast["data_loading_max_s"] == slow["data_loading_max_s"] == slow["data_loading_s"]
        assert fast["data_loading_min_s"] == slow["data_loading_min_s"] == fast["data_loading_s"]
        assert slow["data_loading_s"] >= 0.02  # the slowed rank's sleep, at least


def _stalled(records) -> list[str]:
    return [r.getMessage() for r in records if r.getMessage().startswith("StallMonitor:")]


def test_the_stall_warning_names_a_slow_gather_and_its_fix(cache_dir, caplog):
    ds = ShardDataset(cache_dir, 128, seed=1, transform=slow_transform)
    monitor = StallMonitor(ranks=False, warn_pct=5.0)
    with caplog.at_level("WARNING", logger="shardcache"):
        run_steps(monitor, ds, 12, compute_s=0.005)
    (message,) = _stalled(caplog.records)  # once
    assert "the largest stage is gather (reading the sequences" in message
    assert "num_workers" in message and monitor.warned


def _slow_fetches(batches: int, fetch_s: float):
    for k in range(batches):
        time.sleep(fetch_s)  # as if waiting for a download
        stages = {"plan_s": 0.0, "fetch_s": fetch_s, "gather_s": 1e-4, "collate_s": 1e-4}
        yield {"input_ids": torch.zeros(2, 4), "meta": {"k": k, "stage_s": stages}}


def test_the_stall_warning_names_a_slow_fetch_and_its_fix(caplog):
    monitor = StallMonitor(ranks=False, warn_pct=5.0)
    with caplog.at_level("WARNING", logger="shardcache"):
        run_steps(monitor, _slow_fetches(12, 0.004), 12, compute_s=0.004)
    (message,) = _stalled(caplog.records)
    assert "the largest stage is fetch (waiting for downloads from storage" in message
    assert "ReadAheadOptions" in message and "SHARDCACHE_CACHE_DIR" in message


class _Clock:
    """A ``time`` stand-in for the monitor: the tests move it, so the shares are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _clocked_steps(clock: _Clock, monitor, steps: int, fetch_s: float, compute_s: float):
    def batches():
        for k in range(steps):
            clock.now += fetch_s
            yield {
                "input_ids": torch.zeros(2, 4),
                "meta": {"k": k, "stage_s": {"fetch_s": fetch_s}},
            }

    for _ in monitor.wrap(batches()):
        clock.now += compute_s
        monitor.step()


@pytest.mark.parametrize(
    ("warn_pct", "compute_s", "warned"),
    [
        (5.0, 0.0, False),  # a loop with no model: all wait, no warning
        (5.0, 0.0004, False),  # computing under 5% of the time: still none
        (5.0, 0.0006, True),  # just over 5% computing, 94% waiting
        (90.0, 0.001, True),  # 90.9% waiting
        (95.0, 0.001, False),  # under the threshold
        (None, 0.005, False),  # off
    ],
)
def test_the_stall_warning_needs_compute_and_the_threshold(
    warn_pct, compute_s, warned, monkeypatch, caplog
):
    from shardcache.read.device_prefetch import monitor as module

    clock = _Clock()
    monkeypatch.setattr(module, "time", clock)
    monitor = StallMonitor(ranks=False, warn_pct=warn_pct)
    with caplog.at_level("WARNING", logger="shardcache"):
        _clocked_steps(clock, monitor, 12, fetch_s=0.01, compute_s=compute_s)
    assert monitor.warned == warned
    assert len(_stalled(caplog.records)) == int(warned)


def test_the_stall_warning_waits_for_nine_steps(monkeypatch, caplog):
    from shardcache.read.device_prefetch import monitor as module

    clock = _Clock()
    monkeypatch.setattr(module, "time", clock)
    with caplog.at_level("WARNING", logger="shardcache"):
        early = StallMonitor(ranks=False, warn_pct=5.0)
        _clocked_steps(clock, early, 8, fetch_s=0.01, compute_s=0.002)
        assert not early.warned  # the first step and 7 more: not judged yet
        _clocked_steps(clock, early, 1, fetch_s=0.01, compute_s=0.002)
    assert early.warned
    (message,) = _stalled(caplog.records)
    assert "83.3% of the time over steps 2-9" in message


def test_stall_advice_picks_the_copy_or_the_largest_stage():
    from shardcache.read.device_prefetch.monitor import stall_advice

    reader = {"wait_reader_s": 1.0, "wait_copy_s": 0.1, "gather_s": 0.2, "pin_s": 0.5}
    assert stall_advice(reader)[0] == "pin_s"
    copy = {**reader, "wait_copy_s": 2.0}
    stage, sentence = stall_advice(copy)
    assert stage == "copy_s" and "host-to-device copy" in sentence and "2.000 s" in sentence
    assert stall_advice({"collate_s": 0.3, "gather_s": 0.1})[0] == "collate_s"


@pytest.mark.parametrize("bad", [-1, 101, "5", True])
def test_a_bad_warn_pct_is_refused(bad):
    with pytest.raises(ConfigError, match="warn_pct"):
        StallMonitor(warn_pct=bad)
