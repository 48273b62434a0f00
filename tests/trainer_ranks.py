"""One rank of a trainer over a ShardDataset, for tests/test_trainers_ddp.py (run by torchrun).

    python -m torch.distributed.run --nproc_per_node 2 tests/trainer_ranks.py SCENARIO CACHE OUT

Trains a stand-in model for one epoch (gloo, CPU) and writes ``OUT/rank<r>.json``: the rank, the
world size and the ``meta["sample_ids"]`` of every batch the model received. A ConfigError
(a refused set-up) is printed as ``refused: <message>`` with exit status 3.

Scenarios ``hf-chunked`` / ``hf-straight`` train ShardTrainer with its chunked loss / with
Trainer's own, ``trl-dpo`` CachedPairsDPOTrainer on a preference cache; each writes its final
parameters to ``OUT/params<r>.pt``. Scenario ``hf-eval`` trains nothing: it runs
``Trainer.evaluate`` of a seeded tiny Qwen2 over the ``validation`` split (``eval=True``) and
writes ShardTrainer's ``eval_loss``, Trainer's own figure for the same batches, and the
per-token mean computed here batch by batch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch
from torch.utils.data import DataLoader

import shardcache
from shardcache import ConfigError, ShardDataset, Split
from shardcache.integrations.hf import ShardTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 128
SEED = 1
#: The held-out split and batch budget of ``hf-eval`` (9 evaluation batches on the test
#: cache: one rank of two gets a filler batch).
EVAL_SPLITS = Split(validation=0.3)
EVAL_TOKENS = 64


class CountingLM(torch.nn.Module):
    """A stand-in causal LM that records the sample ids of every batch it trains on."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8)
        self.seen: list[list[int]] = []

    def forward(self, input_ids, labels, attention_mask=None, meta=None, **_):
        self.seen.append(meta["sample_ids"].tolist())
        logits = self.embed(input_ids) @ self.embed.weight.T
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        return {"loss": loss}


def recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "recipes", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf(cache: str, out: str, model: CountingLM, use_loader: bool) -> tuple[int, dict]:
    from transformers import Trainer, TrainingArguments

    steps = ShardDataset(cache, MAX_TOKENS, seed=SEED).batches_per_rank()  # (any rank: equal)
    args = TrainingArguments(
        output_dir=out, max_steps=steps, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, per_device_train_batch_size=1, logging_steps=1000,
    )  # fmt: skip
    if use_loader:  # ShardTrainer: get_train_dataloader returns shardcache.loader(...)
        shard_loader = shardcache.loader(cache, MAX_TOKENS, seed=SEED, num_workers=0)
        # (CountingLM computes its own loss from whole logits: chunk_tokens=0)
        trainer = ShardTrainer(model=model, args=args, shard_loader=shard_loader, chunk_tokens=0)
    else:  # what the user wrote: Trainer's own DataLoader, through accelerate
        trainer = Trainer(model=model, args=args, data_collator=lambda items: items[0],
                          train_dataset=ShardDataset(cache, MAX_TOKENS, seed=SEED))  # fmt: skip
    trainer.train()
    last = trainer.state.log_history[-1]  # the summary log: the monitor's figures of the run
    loading = {k: v for k, v in last.items() if k.startswith("data_loading")}
    return trainer.args.process_index, {"data_loading": loading}


def hf_eval(cache: str, out: str, vocab: int) -> tuple[int, dict]:
    from transformers import Trainer, TrainingArguments

    class StraightTrainer(ShardTrainer):
        """ShardTrainer's loaders with Trainer's own evaluation loss."""

        compute_loss = Trainer.compute_loss
        evaluation_loop = Trainer.evaluation_loop

    torch.manual_seed(0)
    model = recipe("train_loop").tiny_model(vocab, 32, 64)
    args = TrainingArguments(output_dir=out, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True)  # fmt: skip
    ds = ShardDataset(cache, EVAL_TOKENS, split="validation", splits=EVAL_SPLITS, eval=True)
    found = {}
    for name, cls in (("recipe", ShardTrainer), ("straight", StraightTrainer)):
        shard_loader = shardcache.loader(cache, MAX_TOKENS, seed=SEED, num_workers=0)
        trainer = cls(model=model, args=args, shard_loader=shard_loader, eval_dataset=ds)
        found[name] = trainer.evaluate()
    # the per-token mean by hand: each batch's mean loss times its label tokens, summed
    sums = torch.zeros(3, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for batch in ds:
            count = int(batch["labels"][:, 1:].ne(-100).sum())
            sums[2] += float(batch["meta"]["filler"])
            if count:
                loss = model(**shardcache.model_inputs(batch)).loss
                sums[0] += loss.double() * count
                sums[1] += count
    fillers = int(sums[2])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    report = {
        "eval_loss": found["recipe"]["eval_loss"],
        "eval_tokens": found["recipe"]["eval_tokens"],
        "straight_eval_loss": found["straight"]["eval_loss"],
        "reference": float(sums[0] / sums[1]),
        "reference_tokens": int(sums[1]),
        "fillers": fillers,
        "batches": len(ds),
    }
    return trainer.args.process_index, report


def hf_train(cache: str, out: str, vocab: int, scenario: str) -> tuple[int, dict]:
    """ShardTrainer over a tiny Qwen2, 4 SGD steps of 2 accumulated batches (SGD: Adam would
    blow float noise in zero gradients, a key bias's, up to steps of the learning rate); the
    final parameters go to ``OUT/params<rank>.pt``. ``hf-chunked``: the loss in chunks of 5
    positions; ``hf-straight``: Trainer's own loss (the model's, whole logits)."""
    from transformers import Trainer, TrainingArguments

    class StraightTrainer(ShardTrainer):
        compute_loss = Trainer.compute_loss

    torch.manual_seed(0)
    model = recipe("train_loop").tiny_model(vocab, 32, 64)
    args = TrainingArguments(
        output_dir=out, max_steps=4, gradient_accumulation_steps=2, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    shard_loader = shardcache.loader(cache, MAX_TOKENS, seed=SEED, num_workers=0)
    cls = ShardTrainer if scenario == "hf-chunked" else StraightTrainer
    trainer = cls(model=model, args=args, shard_loader=shard_loader, chunk_tokens=5)
    trainer.train()
    rank = trainer.args.process_index
    params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(params, os.path.join(out, f"params{rank}.pt"))
    return rank, {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


def trl_dpo(cache: str, out: str, vocab: int) -> tuple[int, dict]:
    """CachedPairsDPOTrainer on ``trl_pairs(cache)`` (a preference cache), 3 steps of 2 pairs a
    rank; the final parameters go to ``OUT/params<rank>.pt``."""
    import copy

    from transformers import AutoTokenizer
    from trl import DPOConfig

    from shardcache.integrations.hf import CachedPairsDPOTrainer, trl_pairs

    tokenizer = shardcache.open_cache(cache).manifest["tokenizer"]["path"]
    torch.manual_seed(0)
    model = recipe("train_loop").tiny_model(vocab, 32, 256)
    config = DPOConfig(
        output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        activation_checkpointing=False, max_length=None, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = CachedPairsDPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=config, train_dataset=trl_pairs(cache),
        processing_class=AutoTokenizer.from_pretrained(tokenizer),
    )  # fmt: skip
    trainer.train()
    rank = trainer.args.process_index
    params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(params, os.path.join(out, f"params{rank}.pt"))
    return rank, {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


def accelerate_run(cache: str, model: CountingLM, use_loader: bool) -> int:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    if use_loader:
        data = shardcache.loader(cache, MAX_TOKENS, seed=SEED, device=accelerator.device)
    else:
        data = DataLoader(ShardDataset(cache, MAX_TOKENS, seed=SEED), batch_size=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, optimizer, data = accelerator.prepare(model, optimizer, data)
    for batch in data:
        loss = wrapped(**batch)["loss"]
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return accelerator.process_index


def lightning_run(cache: str, model: CountingLM) -> int:
    import lightning

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # built before fit(), as scripts do: under Lightning's own launcher the process group
    # starts in fit()
    data = DataLoader(ShardDataset(cache, MAX_TOKENS, seed=SEED), batch_size=None)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Module(), train_dataloaders=data)
    return trainer.global_rank


def main() -> int:
    scenario, cache, out = sys.argv[1:4]
    vocab = int(shardcache.open_cache(cache).manifest["tokenizer"]["vocab_size"])
    model = CountingLM(vocab)
    report: dict = {}
    try:
        if scenario == "hf-eval":
            rank, report = hf_eval(cache, out, vocab)
        elif scenario in ("hf-chunked", "hf-straight"):
            rank, report = hf_train(cache, out, vocab, scenario)
        elif scenario == "trl-dpo":
            rank, report = trl_dpo(cache, out, vocab)
        elif scenario in ("hf-dataset", "hf-loader"):
            rank, report = hf(cache, out, model, use_loader=scenario == "hf-loader")
        elif scenario in ("accelerate-dataloader", "accelerate-loader"):
            rank = accelerate_run(cache, model, use_loader=scenario == "accelerate-loader")
        elif scenario == "lightning":
            rank = lightning_run(cache, model)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    except ConfigError as err:
        print(f"refused: {err}", file=sys.stderr, flush=True)
        return 3
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "world_size": world, "ids": model.seen, **report}, f)
    if torch.distributed.is_initialized():  # (left to exit, gloo's threads may abort the rank)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
