"""ShardDataset under the trainers people use, two ranks (gloo, CPU), one epoch each: every rank
trains on its own share exactly once (``meta["sample_ids"]`` counted per rank, against the
dataset's own split), or the set-up is refused before a step with the fix named. The scenarios
are in tests/trainer_ranks.py; tests/read/test_trainers.py covers the same logic in one process."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from shardcache import ShardDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "trainer_ranks.py")
MAX_TOKENS, SEED = 128, 1  # as in trainer_ranks.py

pytestmark = pytest.mark.slow  # each run starts two processes that import a trainer (~30 s)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, tokenizer_dir):
    from conftest import make_texts, write_records
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path_factory.mktemp("trainers-corpus")
    for f in range(2):
        records = [{"text": t} for t in make_texts(30, seed=f)]
        write_records(str(folder / f"part-{f}.jsonl"), records, "jsonl")
    out = str(tmp_path_factory.mktemp("trainers") / "cache")
    options = {"input": str(folder), "tokenizer": tokenizer_dir, "output": out, "workers": 1,
               "max_length": 64, "truncation": "split", "buckets": "16,32"}  # fmt: skip
    build_cache(build_options_from_mapping(options))
    return out


def run(scenario: str, cache: str, out, torchrun: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
               OMP_NUM_THREADS="1")  # fmt: skip
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
              "2"] if torchrun else [sys.executable]  # fmt: skip
    command = [*launch, SCRIPT, scenario, cache, str(out)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def assert_each_rank_read_its_share_once(cache: str, out) -> None:
    shares = [
        [b["meta"]["sample_ids"].tolist() for b in ShardDataset(cache, MAX_TOKENS, seed=SEED,
                                                               rank=r, world_size=2)]
        for r in range(2)
    ]  # fmt: skip
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, report in enumerate(reports):
        assert report["rank"] == r and report["world_size"] == 2
        assert len(report["ids"]) == len(shares[r]) > 0  # every step of the epoch
        assert report["ids"] == shares[r]  # its own batches, each once, in its order
    docs = collections.Counter(s for report in reports for b in report["ids"] for s in b)
    assert set(docs.values()) == {1}  # no document twice, on one rank or across ranks


def output(done: subprocess.CompletedProcess) -> str:
    return done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("scenario", ["hf-loader", "accelerate-loader", "lightning"])
def test_every_rank_trains_on_its_own_share_once(scenario, cache_dir, tmp_path):
    done = run(scenario, cache_dir, tmp_path)
    assert done.returncode == 0, output(done)
    assert_each_rank_read_its_share_once(cache_dir, tmp_path)
    if scenario == "hf-loader":  # StallMonitorCallback: the wait of the slowest / fastest rank
        loading = [json.loads((tmp_path / f"rank{r}.json").read_text())["data_loading"]
                   for r in range(2)]  # fmt: skip
        assert loading[0]["data_loading_max_s"] == loading[1]["data_loading_max_s"]
        assert loading[0]["data_loading_min_s"] == loading[1]["data_loading_min_s"]
        for figures in loading:
            low, high = figures["data_loading_min_s"], figures["data_loading_max_s"]
            assert 0 < low <= figures["data_loading_s"] <= high


def test_lightning_own_launcher_with_the_dataset_built_before_fit(cache_dir, tmp_path):
    # `python train.py` with devices=2: Lightning starts rank 1 and the process group itself
    done = run("lightning", cache_dir, tmp_path, torchrun=False)
    assert done.returncode == 0, output(done)
    assert_each_rank_read_its_share_once(cache_dir, tmp_path)


@pytest.mark.parametrize("scenario", ["hf-dataset", "accelerate-dataloader"])
def test_accelerate_splitting_the_dataset_again_is_refused_before_a_step(
    scenario, cache_dir, tmp_path
):
    done = run(scenario, cache_dir, tmp_path)
    assert done.returncode != 0, output(done)
    assert done.stderr.count("refused: ") == 2, output(done)  # both ranks, at start
    assert "DataLoaderDispatcher" in done.stderr and "get_train_dataloader" in done.stderr
    assert not list(tmp_path.glob("rank*.json"))  # no rank trained


def test_hf_trainer_eval_loss_is_the_same_on_one_and_two_processes(cache_dir, tmp_path):
    # Trainer.evaluate over ShardDataset(split="validation", eval=True) through the recipe's
    # ShardTrainer: the per-token mean loss of the split, whatever the number of processes
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    for out, torchrun in ((one, False), (two, True)):
        done = run("hf-eval", cache_dir, out, torchrun=torchrun)
        assert done.returncode == 0, output(done)
    (alone,) = [json.loads((one / "rank0.json").read_text())]
    pair = [json.loads((two / f"rank{r}.json").read_text()) for r in range(2)]
    assert alone["world_size"] == 1 and [r["world_size"] for r in pair] == [2, 2]
    # an odd number of validation batches: two ranks yield one more each, one a filler
    total = alone["batches"]
    assert total % 2 == 1 and total > 2, total
    assert alone["fillers"] == 0 and sum(r["fillers"] for r in pair) == 1
    assert pair[0]["batches"] == pair[1]["batches"] == (total + 1) // 2
    for report in (alone, *pair):
        assert report["eval_tokens"] == report["reference_tokens"] == alone["reference_tokens"]
        assert report["eval_loss"] == pytest.approx(alone["reference"], rel=1e-5, abs=1e-5)
    assert pair[0]["eval_loss"] == pair[1]["eval_loss"]  # one figure, reduced over the ranks


def load_params(out) -> list[dict]:
    import torch

    return [torch.load(out / f"params{r}.pt") for r in range(2)]


def test_shard_trainer_chunked_loss_trains_as_trainer_own_loss_on_two_ranks(cache_dir, tmp_path):
    """ShardTrainer's chunked loss (chunks of 5 positions) through DDP with gradient
    accumulation: both ranks end with the same parameters (the gradients went through DDP's
    all-reduce), and they are the parameters Trainer's own loss (whole logits) trains to."""
    import torch

    found = {}
    for scenario in ("hf-chunked", "hf-straight"):
        out = tmp_path / scenario
        out.mkdir()
        done = run(scenario, cache_dir, out)
        assert done.returncode == 0, output(done)
        ranks = load_params(out)
        assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0]), scenario
        found[scenario] = (ranks[0], json.loads((out / "rank0.json").read_text())["losses"])
    (chunked, chunked_losses), (straight, straight_losses) = found.values()
    assert len(chunked_losses) == len(straight_losses) == 4
    assert chunked_losses == pytest.approx(straight_losses, rel=1e-4)
    for name, value in chunked.items():
        assert torch.allclose(value, straight[name], rtol=1e-4, atol=1e-5), name
    assert chunked_losses[-1] < chunked_losses[0]  # it trained


def test_cached_pairs_dpo_trainer_on_two_ranks(pairs_cache, tmp_path):
    """TRL's DPOTrainer through CachedPairsDPOTrainer on trl_pairs of a cache, two ranks: the
    first loss is ln 2 (reference = policy), the ranks end with the same parameters."""
    import math

    import torch

    pytest.importorskip("trl")
    done = run("trl-dpo", pairs_cache, tmp_path)
    assert done.returncode == 0, output(done)
    ranks = load_params(tmp_path)
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    losses = json.loads((tmp_path / "rank0.json").read_text())["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
