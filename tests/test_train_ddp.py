"""The DDP recipe under ``torchrun --nproc_per_node 2`` (gloo, CPU): one full epoch with two
DataLoader workers per rank; equal steps and exact coverage from its JSON report."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from shardcache import open_cache, read_run_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torchrun_two_ranks_full_epoch(corpus, build_cache, tokenizer_dir, tmp_path):
    # pack/concat: coverage is checked token by token (pad mode is the same path minus packing)
    extra = ["--mode", "pack", "--seq-len", "96", "--packing", "concat"]
    folder, _ = corpus("jsonl", n_files=2, docs=60)
    cache_dir = build_cache(folder, tokenizer_dir, max_length=96, truncation="split",
                            buckets="16,32,64")  # fmt: skip
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    recipe = os.path.join(ROOT, "recipes", "train_ddp.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", recipe, cache_dir, "--max-tokens", "384",
               "--num-workers", "2", "--report", str(report), "--log-every", "2",
               *extra]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # it says what it measures and prints progress (a silent run looked hung)
    assert "measuring: steps/s" in out.stdout and "folded to" in out.stdout
    assert "step 2/" in out.stdout and "steps/s" in out.stdout.split("step 2/", 1)[1]
    data = json.loads(report.read_text())
    ranks = data["ranks"]
    assert data["world_size"] == 2 and len(ranks) == 2
    assert ranks[0]["steps"] == ranks[1]["steps"] and ranks[0]["steps"][0] > 0
    assert "waited for data" in out.stdout and "slowest rank" in out.stdout
    # the StallMonitor's figures: the same max / min over the ranks on both, bounding each
    loading = [r["data_loading"] for r in ranks]
    assert loading[0]["batches"] == loading[1]["batches"] == ranks[0]["steps"][0]
    for name in ("data_loading_max_s", "data_loading_min_s"):
        assert loading[0][name] == pytest.approx(loading[1][name])
    for figures in loading:
        assert figures["data_loading_min_s"] <= figures["data_loading_s"] + 1e-9
        assert figures["data_loading_s"] <= figures["data_loading_max_s"] + 1e-9
    cache = open_cache(cache_dir)
    tokens = collections.Counter()
    for r in ranks:
        for sid, offset, n in r["segments"]:
            for t in range(offset, offset + n):
                tokens[(sid, t)] += 1
    assert set(tokens.values()) == {1}  # nothing twice
    expected = sum(len(cache.read(s)) for s in range(cache.num_sequences))
    assert len(tokens) == expected - data["tail"]["dropped_tokens"]  # nothing lost but the tail


def test_max_steps_stops_every_rank_at_the_same_step_with_the_state_there(
    corpus, build_cache, tokenizer_dir, tmp_path
):
    folder, _ = corpus("jsonl", n_files=1, docs=60)
    cache_dir = build_cache(folder, tokenizer_dir, max_length=96, truncation="split",
                            buckets="16,32,64")  # fmt: skip
    report, state = tmp_path / "report.json", tmp_path / "state.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    recipe = os.path.join(ROOT, "recipes", "train_ddp.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", recipe, cache_dir, "--max-tokens", "256",
               "--num-workers", "0", "--report", str(report), "--save-state", str(state),
               "--epochs", "3", "--max-steps", "3"]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = json.loads(report.read_text())["ranks"]
    assert [r["steps"] for r in ranks] == [[3], [3]]
    saved = json.loads(state.read_text())
    assert (saved["epoch"], saved["consumed"]) == (0, 6)  # 3 global steps of 2 ranks
    # the run record beside the state, and the command that rewinds the last step (step 2)
    assert f"shardcache rewind {tmp_path} --step 2" in out.stdout
    record = read_run_record(tmp_path)
    assert (record.world_size, record.grad_accum) == (2, 1)
    assert record.step_at(saved["epoch"], saved["consumed"]) == 3
