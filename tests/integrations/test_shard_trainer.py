"""ShardTrainer in one process: its chunked loss is Trainer's own (per batch and over training with
gradient accumulation), its evaluation is per token, and bad set-ups are refused at construction.
Two ranks: tests/test_trainers_ddp.py."""

from __future__ import annotations

import copy

import pytest
import torch

import shardcache
from conftest import make_model
from shardcache import ConfigError, ShardDataset, Split, StallMonitorCallback
from shardcache.integrations.hf import ShardTrainer

MAX_TOKENS = 128


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=30)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="16,32")


def vocab_of(cache: str) -> int:
    return int(shardcache.open_cache(cache).manifest["tokenizer"]["vocab_size"])


def arguments(tmp_path, **overrides):
    from transformers import TrainingArguments

    settings = {"output_dir": str(tmp_path / "out"), "report_to": [], "save_strategy": "no",
                "use_cpu": True, "disable_tqdm": True, "seed": 0, **overrides}  # fmt: skip
    return TrainingArguments(**settings)


def trainer(cache, tmp_path, model, cls=ShardTrainer, **kwargs) -> ShardTrainer:
    training = kwargs.pop("args", None) or arguments(tmp_path)
    loader = shardcache.loader(cache, MAX_TOKENS, seed=1, num_workers=0)
    return cls(model=model, args=training, shard_loader=loader, **kwargs)


def test_compute_loss_is_trainers_own_with_and_without_num_items(cache_dir, tmp_path):
    from transformers import Trainer

    model = make_model("qwen2", "sdpa", vocab_of(cache_dir))
    ours = trainer(cache_dir, tmp_path, model, chunk_tokens=5)
    batch = next(iter(ShardDataset(cache_dir, MAX_TOKENS, seed=1)))
    count = batch["labels"][:, 1:].ne(-100).sum()
    for items in (None, 3 * count):  # alone, or a third of an accumulated step's tokens
        got = ours.compute_loss(model, batch, num_items_in_batch=items)
        want = Trainer.compute_loss(ours, model, batch, num_items_in_batch=items)
        assert got.item() == pytest.approx(want.item(), rel=1e-6), items


def test_training_with_accumulation_reaches_the_parameters_of_trainers_own_loss(
    cache_dir, tmp_path
):
    from transformers import Trainer

    class Straight(ShardTrainer):
        compute_loss = Trainer.compute_loss

    model = make_model("qwen2", "sdpa", vocab_of(cache_dir))
    found = []
    for cls in (ShardTrainer, Straight):
        args = arguments(tmp_path, max_steps=3, gradient_accumulation_steps=2, optim="sgd",
                         learning_rate=0.5, lr_scheduler_type="constant",
                         logging_steps=1)  # fmt: skip
        run = trainer(cache_dir, tmp_path, copy.deepcopy(model), cls, args=args, chunk_tokens=5)
        run.train()
        found.append((run.model, [e["loss"] for e in run.state.log_history if "loss" in e]))
    (chunked, chunked_losses), (straight, straight_losses) = found
    assert chunked_losses == pytest.approx(straight_losses, rel=1e-5)
    for (name, a), b in zip(chunked.named_parameters(), straight.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name
    assert not torch.equal(next(chunked.parameters()), next(model.parameters()))  # it trained


@pytest.mark.parametrize("chunk_tokens", [None, 0])
def test_eval_loss_is_the_per_token_mean_of_the_split(cache_dir, tmp_path, chunk_tokens):
    model = make_model("qwen2", "sdpa", vocab_of(cache_dir)).eval()
    splits = Split(validation=0.3)
    held_out = ShardDataset(cache_dir, 64, split="validation", splits=splits, eval=True)
    ours = trainer(cache_dir, tmp_path, model, eval_dataset=held_out, chunk_tokens=chunk_tokens)
    metrics = ours.evaluate()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in held_out:
            n = int(batch["labels"][:, 1:].ne(-100).sum())
            if n:
                total += model(**shardcache.model_inputs(batch)).loss.item() * n
                count += n
    assert metrics["eval_tokens"] == count > 0
    assert metrics["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_the_stall_monitor_comes_first_or_not_at_all(cache_dir, tmp_path):
    model = make_model("qwen2", "sdpa", vocab_of(cache_dir))
    ours = trainer(cache_dir, tmp_path, model)
    assert isinstance(ours.stall_monitor, StallMonitorCallback)
    assert ours.callback_handler.callbacks[0] is ours.stall_monitor
    given = StallMonitorCallback(warn_pct=None)
    assert trainer(cache_dir, tmp_path, model, stall_monitor=given).stall_monitor is given
    none = trainer(cache_dir, tmp_path, model, stall_monitor=False)
    assert none.stall_monitor is None
    assert not any(isinstance(c, StallMonitorCallback) for c in none.callback_handler.callbacks)


def test_bad_set_ups_are_refused_at_construction(cache_dir, tmp_path):
    model = make_model("qwen2", "sdpa", vocab_of(cache_dir))
    loader = shardcache.loader(cache_dir, MAX_TOKENS, num_workers=0)
    with pytest.raises(ConfigError, match=r"train_dataset is given.*leave train_dataset out"):
        ShardTrainer(model=model, args=arguments(tmp_path), shard_loader=loader,
                     train_dataset=loader.dataset)  # fmt: skip
    with pytest.raises(ConfigError, match="shard_loader is a ShardDataset; pass the ShardLoader"):
        ShardTrainer(model=model, args=arguments(tmp_path), shard_loader=loader.dataset)
    with pytest.raises(ConfigError, match=r"compute_metrics read.*pass chunk_tokens=0"):
        trainer(cache_dir, tmp_path, model, compute_metrics=lambda p: {})
    with pytest.raises(ConfigError, match="stall_monitor is 'yes'"):
        trainer(cache_dir, tmp_path, model, stall_monitor="yes")
    with pytest.raises(ConfigError, match="chunk_tokens is -3"):
        trainer(cache_dir, tmp_path, model, chunk_tokens=-3)
    capped = make_model("qwen2", "sdpa", vocab_of(cache_dir))
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match=r"final_logit_softcapping.*chunk_tokens=0"):
        trainer(cache_dir, tmp_path, capped)
    trainer(cache_dir, tmp_path, capped, chunk_tokens=0)  # the whole logits: accepted
