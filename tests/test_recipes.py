"""The training recipes run end to end on CPU with a tiny random model on a tiny cache: the loss
is finite and falls, the reader state resumes the same stream, progress is printed."""

from __future__ import annotations

import itertools
import math
import os

import pytest

import shardcache
from conftest import load_recipe as recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="16,32")


SMALL = ["--max-tokens", "256", "--seq-len", "64"]


def test_train_loop_loss_falls_on_a_repeated_batch(cache_dir, capsys, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = recipe("train_loop")
    report = train.main([cache_dir, *SMALL, "--steps", "8", "--overfit-batch",
                         "--num-workers", "0", "--log-every", "4",
                         "--tensorboard", str(tmp_path / "tb")])  # fmt: skip
    losses = report["losses"]
    assert len(losses) == 8 and all(a > b for a, b in itertools.pairwise(losses))
    batches = report["batches"]
    assert len(batches) == 8 and all(b == batches[0] for b in batches)  # one batch, repeated
    out = capsys.readouterr().out
    assert "parameters" in out and "step 4: loss" in out and "step 8: loss" in out
    assert out.count("waited for data") == 2
    loading = report["data_loading"]  # the StallMonitor's figures of every step
    assert len(loading) == 8 and all(0 <= f["data_loading_pct"] <= 100 for f in loading)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("data/data_loading_pct")
    assert [s.step for s in scalars] == list(range(8))
    assert [s.value for s in scalars] == pytest.approx([f["data_loading_pct"] for f in loading])


def test_train_loop_resume_continues_the_same_stream(cache_dir, tmp_path):
    train = recipe("train_loop")
    common = [cache_dir, *SMALL, "--log-every", "100"]
    full = train.main([*common, "--steps", "7", "--num-workers", "0"])
    assert len(full["batches"]) == 7 and full["state"]["epoch"] >= 1  # crosses an epoch
    state = str(tmp_path / "reader.json")
    head = train.main([*common, "--steps", "3", "--num-workers", "2", "--save-state", state])
    tail = train.main([*common, "--steps", "4", "--num-workers", "0", "--resume", state])
    assert head["batches"] + tail["batches"] == full["batches"]
    assert tail["state"] == full["state"]


def test_hf_trainer_consumes_packed_batches_and_the_loss_falls(cache_dir, tmp_path, capsys):
    train = recipe("train_hf_trainer")
    report = train.main([cache_dir, *SMALL, "--output-dir", str(tmp_path / "out"),
                         "--max-steps", "12", "--logging-steps", "3",
                         "--num-workers", "0", "--validation", "0.25"])  # fmt: skip
    losses = report["losses"]  # steps 1 (logging_first_step), 3, 6, 9, 12
    assert len(losses) == 5 and all(a > b for a, b in itertools.pairwise(losses))
    assert report["last_epoch"] >= 1  # Trainer called set_epoch on the loader
    data = report["data_loading"]  # StallMonitorCallback's figures in the last log
    assert set(data) == set(train.MONITOR_KEYS)
    assert 0 <= data["data_loading_pct"] <= 100 and data["wait_reader_s"] >= 0
    held_out = report["eval"]  # on the validation split, per token
    assert held_out["eval_tokens"] > 0 and 0 < held_out["eval_loss"] < 20
    out = capsys.readouterr().out
    assert "12 steps; mean loss" in out and "data loading (last log)" in out
    assert "step 1/12: loss" in out and "step 12/12: loss" in out  # progress as it trains
    assert "eval_loss" in out


def test_hf_trainer_one_step_reports_its_loss(cache_dir, tmp_path, capsys):
    """``--max-steps 1`` (no log step came before the end) trains, logs and exits cleanly."""
    train = recipe("train_hf_trainer")
    report = train.main([cache_dir, *SMALL, "--output-dir", str(tmp_path / "out"),
                         "--max-steps", "1", "--num-workers", "0"])  # fmt: skip
    assert len(report["losses"]) == 1 and math.isfinite(report["losses"][0])
    assert report["train_loss"] == pytest.approx(report["losses"][0])
    out = capsys.readouterr().out
    assert "step 1/1: loss" in out
    # the run record beside the output, and the command that rewinds the step it stopped at
    assert f"shardcache rewind {tmp_path / 'out'} --step 0" in out
    (batch,) = shardcache.rewind(tmp_path / "out", 0)
    assert (batch["step"], batch["rank"], batch["micro"]) == (0, 0, 0) and batch["rows"]


@pytest.mark.parametrize(
    ("name", "blocked", "arguments"),
    [
        ("train_hf_trainer", "accelerate", ["--output-dir", "OUT"]),
        ("train_dpo_trl", "trl", ["TOKENIZER", "--output-dir", "OUT"]),
        ("train_dpo_trl", "datasets", ["TOKENIZER", "--output-dir", "OUT"]),
    ],
)
def test_a_recipe_without_the_train_extra_names_it(name, blocked, arguments, tmp_path):
    """The framework a recipe needs, made unimportable: the recipe exits 1 naming the extra
    to install, not with an ImportError's traceback."""
    import subprocess
    import sys

    args = [str(tmp_path / "cache"), *arguments]
    args = [str(tmp_path / "out") if a == "OUT" else "tok" if a == "TOKENIZER" else a
            for a in args]  # fmt: skip
    code = (f"import sys, runpy; sys.modules[{blocked!r}] = None; sys.argv = {[name, *args]!r}; "
            f"runpy.run_path({os.path.join(ROOT, 'recipes', name + '.py')!r}, "
            "run_name='__main__')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"needs {blocked}" in done.stderr and 'pip install -e ".[train]"' in done.stderr


@pytest.fixture(scope="module")
def dpo_cache(tmp_path_factory) -> str:
    """The bundled preference pairs built with ``recipes/dpo.toml``."""
    from click.testing import CliRunner

    from shardcache.cli import main

    out = str(tmp_path_factory.mktemp("dpo") / "cache")
    recipe_path = os.path.join(ROOT, "recipes", "dpo.toml")
    result = CliRunner().invoke(main, ["build", recipe_path, "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    return out


def test_dpo_recipe_builds_the_bundled_pairs(dpo_cache):
    from shardcache import open_cache

    cache = open_cache(dpo_cache)
    assert cache.is_preference and cache.num_sequences == 2 * 591
    assert cache.lookup(0).source.endswith("pairs.jsonl.zst") and cache.lookup(1).piece == 1


@pytest.fixture()
def small_pairs_cache(build_cache, tokenizer_dir, tmp_path) -> str:
    """60 string pairs of random words (vocab 600: fast steps)."""
    import random

    from conftest import WORDS, write_records

    rng = random.Random(0)
    records = [
        {"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 6))),
         "chosen": " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 8))),
         "rejected": " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))}
        for _ in range(60)
    ]  # fmt: skip
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    return build_cache(path, tokenizer_dir, kind="preference", buckets="16,32")


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_train_dpo_epoch_reads_every_pair_once_llama(small_pairs_cache, mode):
    from shardcache import ShardDataset

    cache = small_pairs_cache
    train = recipe("train_dpo")
    packing = {"mode": "pack", "seq_len": 64, "attention": "mask"} if mode == "pack" else {}
    steps = len(ShardDataset(cache, 256, seed=0, **packing))
    report = train.main([cache, "--max-tokens", "256", "--steps", str(steps), "--arch", "llama",
                         "--hidden", "32", "--log-every", "100", "--mode", mode,
                         "--seq-len", "64"])  # fmt: skip
    pairs = [p for batch in report["pairs"] for p in batch]
    assert sorted(pairs) == list(range(60)) and steps > 3
    assert report["reference_forwards"] == steps  # once per batch
    assert report["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    assert all(math.isfinite(x) for x in report["losses"])
    if mode == "pack":  # several pairs a row: 4 rows of 64 slots a batch
        assert max(len(batch) for batch in report["pairs"]) > 256 // 64


def test_train_dpo_chunked_log_probs_train_as_the_whole_logits(small_pairs_cache, capsys):
    """The recipe's default computes the log-probs a chunk of positions at a time; chunks of 3
    positions and the whole logits give the same losses step after step."""
    train = recipe("train_dpo")
    common = [small_pairs_cache, "--max-tokens", "256", "--steps", "4", "--hidden", "32",
              "--log-every", "2", "--lr", "1e-2"]  # fmt: skip
    chunked = train.main([*common, "--chunk-tokens", "3"])["losses"]
    whole = train.main([*common, "--chunk-tokens", "0"])["losses"]
    assert chunked == pytest.approx(whole, rel=1e-4, abs=1e-6)
    assert chunked[-1] != pytest.approx(chunked[0], abs=1e-4)  # it trained
    out = capsys.readouterr().out
    assert "step 1: loss" in out and "step 2: loss" in out  # progress from the first step


def test_train_dpo_resume_continues_the_same_pairs(small_pairs_cache, tmp_path):
    train = recipe("train_dpo")
    common = [small_pairs_cache, "--max-tokens", "192", "--hidden", "32", "--log-every", "100"]
    full = train.main([*common, "--steps", "7"])
    state = str(tmp_path / "reader.json")
    head = train.main([*common, "--steps", "3", "--save-state", state])
    tail = train.main([*common, "--steps", "4", "--resume", state])
    assert head["pairs"] + tail["pairs"] == full["pairs"]
    assert tail["state"] == full["state"]


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_train_dpo_starts_at_ln2_and_the_loss_falls_on_a_repeated_batch(
    small_pairs_cache, capsys, mode
):
    train = recipe("train_dpo")
    report = train.main([small_pairs_cache, "--max-tokens", "256", "--steps", "6",
                         "--overfit-batch", "--lr", "3e-4", "--hidden", "32",
                         "--log-every", "3", "--mode", mode])  # fmt: skip
    losses = report["losses"]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # step 0: policy = reference
    assert len(losses) == 6 and all(a > b for a, b in itertools.pairwise(losses))
    assert report["accuracies"][-1] == 1.0
    assert report["reference_forwards"] == 1  # the batch's reference log-probs, computed once
    assert all(p == report["pairs"][0] for p in report["pairs"])
    out = capsys.readouterr().out
    assert "60 pairs" in out and "step 3: loss" in out and "step 6: loss" in out
    assert f"({mode} mode" in out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dpo_pair_logps_are_the_completion_tokens_of_each_sequence_alone(dpo_cache, arch, attn):
    """Per pair of a padded pair batch, the recipe's ``pair_logps`` are the sums over each
    sequence alone (no padding) of the log-probs of its completion: the tokenizer's ids of the
    record's ``chosen`` / ``rejected`` text plus EOS, after the ids of its prompt."""
    import json

    import numpy as np
    import torch
    import zstandard
    from transformers import AutoTokenizer

    from shardcache import ShardDataset, open_cache

    train = recipe("train_dpo")
    cache = open_cache(dpo_cache)
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "recipes", "quickstart", "tokenizer"))
    path = os.path.join(ROOT, "recipes", "quickstart", "preference", "pairs.jsonl.zst")
    with open(path, "rb") as f:
        lines = zstandard.ZstdDecompressor().stream_reader(f).read().decode().splitlines()
    torch.manual_seed(0)
    model = train.tiny_model(4096, 32, 256, arch, attn).eval()
    batch = next(iter(ShardDataset(dpo_cache, 1024, seed=1)))
    assert len(set((batch["attention_mask"].sum(1)).tolist())) > 1  # rows of unequal length
    with torch.no_grad():
        chosen, rejected = train.pair_logps(model, batch)
        pairs = train.batch_pairs(batch)
        assert len(chosen) == len(rejected) == len(pairs) == batch["input_ids"].shape[0] // 2
        for sample in batch["meta"]["sample_ids"].tolist():
            record = json.loads(lines[cache.lookup(sample).record])
            prompt = tok(record["prompt"])["input_ids"]
            completion = tok(record["chosen" if sample % 2 == 0 else "rejected"])["input_ids"]
            ids = torch.tensor([prompt + completion + [tok.eos_token_id]])
            assert ids[0].tolist() == cache.read(sample).tolist()
            logps = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            picked = logps[np.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1 :]
            assert len(picked) == len(completion) + 1
            got = (chosen if sample % 2 == 0 else rejected)[pairs.tolist().index(sample // 2)]
            assert got.item() == pytest.approx(picked.sum().item(), rel=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("attention", ["mask", "varlen"])
def test_dpo_pack_mode_equals_pad_mode_per_pair(small_pairs_cache, arch, attention):
    """At step 0, every pair's log-probs (policy and reference) and DPO loss read from packed
    rows equal those read from padded rows, pairs matched by ``meta["pair_ids"]``: the same
    numbers whatever the batch shape (a reference unlike the policy, so losses are not ln 2)."""
    import numpy as np
    import torch

    from shardcache import ShardDataset, open_cache

    train = recipe("train_dpo")
    vocab = int(open_cache(small_pairs_cache).manifest["tokenizer"]["vocab_size"])
    torch.manual_seed(0)
    policy = train.tiny_model(vocab, 32, 128, arch).eval()
    torch.manual_seed(1)
    reference = train.tiny_model(vocab, 32, 128, arch).eval()

    def per_pair(dataset) -> dict[int, list[float]]:
        """pair id -> [policy chosen, policy rejected, reference chosen, ref. rejected, loss]."""
        values: dict[int, list[float]] = {}
        with torch.no_grad():
            for batch in dataset:
                logps = [*train.pair_logps(policy, batch), *train.pair_logps(reference, batch)]
                losses, _ = train.dpo_losses(*logps, 0.1)
                table = torch.stack([*logps, losses], 1).tolist()
                values.update(zip(train.batch_pairs(batch).tolist(), table))
        return values

    pad = per_pair(ShardDataset(small_pairs_cache, 256, seed=0, streams=0))
    packed = ShardDataset(small_pairs_cache, 256, mode="pack", seq_len=64, attention=attention,
                          seed=0, streams=0)  # fmt: skip
    pack = per_pair(packed)
    assert len(pack) > len(packed) * 256 // 64  # more pairs than rows: pairs share rows
    assert sorted(pack) == sorted(pad) == list(range(60))
    got = np.array([pack[k] for k in range(60)])
    want = np.array([pad[k] for k in range(60)])
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(want[:, 4] - math.log(2)).max() > 1e-3  # not the trivial comparison


def test_train_fim_trains_with_fim_and_the_validation_loss_falls(tmp_path, corpus, build_cache):
    from conftest import _save_bpe, make_texts

    sentinels = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>")
    tokenizer = _save_bpe(str(tmp_path / "tok"), make_texts(200, seed=2), 500, bos=False,
                          extra_specials=sentinels)  # fmt: skip
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    cache = build_cache(folder, tokenizer, max_length=64, truncation="split")
    train = recipe("train_fim")
    report = train.main([cache, "--max-tokens", "320", "--seq-len", "80", "--steps", "8",
                         "--eval-every", "4", "--validation", "0.2", "--num-workers", "0",
                         "--split-token", "<eos>", "--max-fragments", "2"])  # fmt: skip
    assert report["growth"] == 6  # 3 sentinels for each of up to 2 fragments, reserved
    assert 0.3 < report["fim_rows"] / report["rows"] <= 1  # (a row packs several documents)
    steps, evals = zip(*report["eval_losses"])
    assert steps == (0, 4, 8) and all(math.isfinite(x) for x in evals)
    assert evals[-1] < evals[0]
