#!/usr/bin/env python3
"""Train a causal LM with transformers' ``Trainer`` reading packed batches from a shardcache cache.

    python recipes/train_hf_trainer.py CACHE --output-dir out --max-steps 200
    torchrun --nproc_per_node 8 recipes/train_hf_trainer.py CACHE --output-dir out

What it shows (copy it):

* ``Trainer`` builds its own ``DataLoader(dataset, batch_size=per_device_train_batch_size)``,
  which would stack whole ``ShardDataset`` batches into a leading dimension (shardcache refuses
  that batch). :class:`ShardTrainer` overrides ``get_train_dataloader`` to return
  ``shardcache.loader(...)``: ``batch_size=None``, workers started with forkserver, and a
  ``set_epoch`` that Trainer calls every epoch (the reshuffle). The batch size is the token
  budget ``--max-tokens``, not ``per_device_train_batch_size``. Trainer's own DataLoader would
  also go through accelerate's dispatcher, which reads every batch on rank 0 and slices it across
  the ranks: ``Trainer(train_dataset=ShardDataset(...))`` is refused at start for that reason;
* ``attention="mask"`` keeps packed documents apart with any attention implementation; with
  ``--attn flash_attention_2`` use ``attention="varlen"`` (the ``cu_seq_lens_*`` keys flash
  attention reads);
* ``ShardDataset`` reads rank and world size from torch.distributed, so under ``torchrun``
  every rank reads its own batches and all ranks take the same number of steps;
* where each step waits for data: :class:`shardcache.StallMonitorCallback` (attached ahead of
  Trainer's reporters) adds ``data_loading_pct``, ``data_loading_s``, the split
  ``wait_reader_s`` / ``wait_copy_s``, the reader's stage times and, under torchrun, the
  slowest and fastest rank's wait (``data_loading_max_s`` / ``_min_s``) to every log, so they
  reach TensorBoard or W&B (``--report-to``) and ``trainer.state.log_history``;
* evaluation on a held-out split: ``eval_dataset=ShardDataset(..., split="validation",
  splits=Split(...), eval=True)`` (``--validation FRACTION``; training then reads
  ``split="train"``). :class:`ShardTrainer` reads it without accelerate's wrappers
  (``get_eval_dataloader``) and reports ``eval_loss`` as the mean over every label token of
  the split, on any number of processes: Trainer's own figure averages the batches' mean
  losses (a token weighs as much as its batch is small) and under torchrun pools each step's
  batches over the ranks first, so it changes with the number of processes (see
  docs/guide/evaluation.md);
* per-message loss weights: a cache built with ``--weight-field`` gives batches a
  ``loss_weights`` tensor; ``ShardTrainer.compute_loss`` then takes
  ``shardcache.weighted_loss`` of the logits (``sum(w * token_loss) / sum(w)`` over the batch;
  with gradient accumulation, the mean of the micro-batches' figures), and ``eval_loss`` is the
  weighted mean over the split (``eval_tokens``: the sum of the weights);
* ``remove_unused_columns`` does not apply (it is for ``datasets.Dataset``): the model receives
  the batch, ``meta`` included, which transformers' causal LMs ignore (strict models: see
  ``shardcache.model_inputs``).

The model is a small random Qwen2 sized from the cache's vocabulary; it is a stand-in: what is
measured is that Trainer consumes the batches and the loss falls. ``--report PATH`` writes the
logged losses, the last log's data-loading figures and the evaluation (JSON). ``--max-steps``
(default 100) ends a run within an epoch.

Memory is the logits', not the reader's: tokens x vocabulary x 4 bytes, about three times over
(logits, softmax, gradient). With a 151k vocabulary a 9.8 M-parameter model on 2 x 2,048-token
rows peaked at 8 GB while the reader held 385 MB; lower ``--max-tokens`` before anything else.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

import shardcache

#: The data-loading figures the recipe reports from the last log (StallMonitorCallback).
MONITOR_KEYS = ("data_loading_pct", "data_loading_s", "wait_reader_s", "wait_copy_s")


class ShardTrainer(Trainer):
    """``Trainer`` whose batches come from shardcache, with a per-token evaluation loss.

    Training reads ``shard_loader``; evaluation reads ``eval_dataset`` (a ``ShardDataset`` with
    ``eval=True``) as it is, without accelerate's wrappers.
    ``eval_loss`` is the sum of the token losses of every label token over every process,
    divided by their count (``eval_tokens``).
    """

    def __init__(self, *args: Any, shard_loader: shardcache.ShardLoader, **kwargs: Any) -> None:
        super().__init__(*args, train_dataset=shard_loader.dataset, **kwargs)
        self.shard_loader = shard_loader
        self._token_loss: torch.Tensor | None = None  # (sum, count) during an evaluation

    def get_train_dataloader(self) -> Any:
        # the whole-batch loader as it is: Trainer moves each batch to the device itself
        return self.shard_loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(data, shardcache.ShardDataset):
            return DataLoader(data, batch_size=None)  # whole batches, this rank's own
        return super().get_eval_dataloader(eval_dataset)

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if "loss_weights" in inputs:  # a cache with per-message loss weights
            return self._weighted_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._token_loss is None:  # training: Trainer's own loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # evaluation: the model's own mean over the batch's label tokens (a causal LM shifts
        # labels; no num_items_in_batch, which Trainer would scale by the processes), times
        # their count, is the batch's sum; an all-ignored filler batch adds nothing
        count = inputs["labels"][..., 1:].ne(-100).sum()
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch=None)
        total = torch.where(count > 0, loss.detach().double() * count, 0.0)
        self._token_loss += torch.stack([total, count.double()]).to(self._token_loss.device)
        return (loss, outputs) if return_outputs else loss

    def _weighted_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any
    ) -> Any:
        """``shardcache.weighted_loss`` of the batch; in evaluation its sum and weight add up."""
        feed = {k: v for k, v in shardcache.model_inputs(inputs).items() if k != "labels"}
        outputs = model(**feed)
        loss = shardcache.weighted_loss(outputs.logits, inputs)
        if self._token_loss is not None:
            weight = inputs["loss_weights"][..., 1:].double().sum()
            total = loss.detach().double() * weight
            self._token_loss += torch.stack([total, weight]).to(self._token_loss.device)
        elif self._scaled_for_accumulation(num_items_in_batch):
            # Trainer leaves a loss it takes as normalised by num_items_in_batch undivided
            steps = getattr(self, "current_gradient_accumulation_steps", None)
            loss = loss / (steps or self.args.gradient_accumulation_steps)
        return (loss, outputs) if return_outputs else loss

    def _scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """Whether Trainer takes the loss as already divided over the accumulated batches."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        accepts = getattr(self, "model_accepts_loss_kwargs", False)
        return bool(accepts and num_items_in_batch is not None) or (
            getattr(self, "compute_loss_func", None) is not None
        )

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        self._token_loss = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(*args, **kwargs)
            sums = self._token_loss
        finally:
            self._token_loss = None
        if self.args.world_size > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        total, count = sums.tolist()
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        output.metrics[f"{prefix}_loss"] = total / count if count else float("nan")
        output.metrics[f"{prefix}_tokens"] = int(count) if count == int(count) else count
        return output


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="transformers Trainer over a shardcache cache")
    parser.add_argument("cache")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget per batch")
    parser.add_argument("--seq-len", type=int, default=1024, help="packed row length")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation of the model")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--validation", type=float, default=0.0,
                        help="hold out this fraction of the documents and evaluate on it "
                        "at the end (0: train on everything, no evaluation)")  # fmt: skip
    parser.add_argument(
        "--report-to",
        default="none",
        help="Trainer's reporters, comma-separated (tensorboard, wandb, ...)",
    )
    parser.add_argument("--report", help="write the logged losses here (JSON)")
    args = parser.parse_args(argv)

    attention = "varlen" if args.attn.startswith("flash") else "mask"
    batches = {"mode": "pack", "seq_len": args.seq_len, "attention": attention}
    held_out: dict[str, Any] = {}
    if args.validation > 0:
        held_out = {"splits": shardcache.Split(validation=args.validation)}
    shard_loader = shardcache.loader(
        args.cache,
        args.max_tokens,
        seed=args.seed,
        num_workers=args.num_workers,
        **batches,
        **({"split": "train", **held_out} if held_out else {}),
    )
    eval_dataset = None
    if held_out:  # every held-out sequence once over all ranks, in a fixed order
        eval_dataset = shardcache.ShardDataset(
            args.cache, args.max_tokens, split="validation", eval=True, **held_out, **batches
        )
    vocab = int(shardcache.open_cache(args.cache).manifest["tokenizer"]["vocab_size"])
    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=2,
        num_attention_heads=max(1, args.hidden // 32),
        num_key_value_heads=max(1, args.hidden // 32),
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=args.attn)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[] if args.report_to == "none" else args.report_to.split(","),
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = ShardTrainer(
        model=model, args=training, shard_loader=shard_loader, eval_dataset=eval_dataset
    )
    # ahead of the reporters, so the data-loading figures reach TensorBoard / W&B too
    shardcache.StallMonitorCallback().attach(trainer)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    losses = [float(e["loss"]) for e in logged]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"the logged losses are not finite: {losses}")
    print(f"{args.max_steps} steps; logged losses {[round(x, 4) for x in losses]}", flush=True)
    data = {k: logged[-1][k] for k in MONITOR_KEYS if k in logged[-1]}
    print("data loading (last log): " + ", ".join(f"{k} {v:.4g}" for k, v in data.items()))
    # Trainer called set_epoch on the loader at every epoch: the dataset reshuffled each time
    report = {"losses": losses, "last_epoch": shard_loader.dataset.epoch, "data_loading": data}
    if eval_dataset is not None:
        metrics = trainer.evaluate()
        report["eval"] = {k: metrics[k] for k in ("eval_loss", "eval_tokens")}
        print(f"eval_loss {metrics['eval_loss']:.4f} over {metrics['eval_tokens']} tokens")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # under torchrun: leave the group before exiting
        torch.distributed.destroy_process_group()
