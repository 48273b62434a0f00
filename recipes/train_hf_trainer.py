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
* ``remove_unused_columns`` does not apply (it is for ``datasets.Dataset``): the model receives
  the batch, ``meta`` included, which transformers' causal LMs ignore (strict models: see
  ``shardcache.model_inputs``).

The model is a small random Qwen2 sized from the cache's vocabulary; it is a stand-in: what is
measured is that Trainer consumes the batches and the loss falls. ``--report PATH`` writes the
logged losses (JSON). ``--max-steps`` (default 100) ends a run within an epoch.

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
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

import shardcache


class ShardTrainer(Trainer):
    """``Trainer`` whose training batches come from ``shardcache.loader``."""

    def __init__(self, *args: Any, shard_loader: shardcache.ShardLoader, **kwargs: Any) -> None:
        super().__init__(*args, train_dataset=shard_loader.dataset, **kwargs)
        self.shard_loader = shard_loader

    def get_train_dataloader(self) -> Any:
        # the whole-batch loader as it is: Trainer moves each batch to the device itself
        return self.shard_loader


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
    parser.add_argument("--report", help="write the logged losses here (JSON)")
    args = parser.parse_args(argv)

    attention = "varlen" if args.attn.startswith("flash") else "mask"
    shard_loader = shardcache.loader(
        args.cache,
        args.max_tokens,
        mode="pack",
        seq_len=args.seq_len,
        attention=attention,
        seed=args.seed,
        num_workers=args.num_workers,
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
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = ShardTrainer(model=model, args=training, shard_loader=shard_loader)
    trainer.train()
    losses = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"the logged losses are not finite: {losses}")
    print(f"{args.max_steps} steps; logged losses {[round(x, 4) for x in losses]}", flush=True)
    # Trainer called set_epoch on the loader at every epoch: the dataset reshuffled each time
    report = {"losses": losses, "last_epoch": shard_loader.dataset.epoch}
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
