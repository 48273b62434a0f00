#!/usr/bin/env python3
"""Train a code model with fill-in-the-middle, and evaluate it on a held-out split.

    python recipes/train_fim.py CACHE --steps 200
    python recipes/train_fim.py CACHE --steps 200 --split-token eos --max-fragments 4

What it shows (copy it):

* ``FIM.from_tokenizer(tokenizer, rate, spm_rate)``: the sentinel ids read from the
  tokenizer's added tokens (checked: a tokenizer without them is refused, naming what it looked
  for); by default the sentinels are *added* (``max_growth = 3``), so ``ShardDataset`` plans
  every sequence 3 tokens longer and no packed row overflows. ``--split-token`` cuts a sequence
  at that token (an EOS joining files) and rewrites each fragment on its own;
* ``split="train"`` / ``split="validation"`` with one ``Split``: the documents evaluated on are
  never trained on, whatever the rebuild;
* an evaluation pass, ``eval=True``: every validation sequence once, in a fixed order, with
  the same FIM rewrites at every evaluation (the transform's generator is seeded by seed,
  epoch, sample id and repetition); the loss is summed over target tokens, not averaged over
  batches.

The model is a small random Qwen2 sized from the cache's vocabulary (``--hidden``, 2 layers): a
stand-in, what is measured is that the validation loss falls. ``--report PATH`` writes the
losses (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import shardcache
from shardcache import FIM, ShardDataset, Split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_loop import tiny_model  # (the recipe next to this one)


def evaluate(model: torch.nn.Module, dataset: ShardDataset, device: torch.device) -> float:
    """The mean loss per target token over one evaluation pass."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in dataset:
            inputs = {k: v.to(device) for k, v in shardcache.model_inputs(batch).items()}
            logits = model(**inputs).logits[:, :-1].float()
            labels = inputs["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
            )  # (-100: ignored, so filler batches add nothing)
            total += loss.item()
            count += int((labels != -100).sum())
    model.train()
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="train with FIM, evaluate on a split")
    parser.add_argument("cache")
    parser.add_argument("--tokenizer", help="default: the one the cache was built with")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget per batch")
    parser.add_argument("--seq-len", type=int, default=1024, help="packed row length")
    parser.add_argument("--fim-rate", type=float, default=0.5)
    parser.add_argument("--spm-rate", type=float, default=0.5)
    parser.add_argument(
        "--split-token",
        help="cut sequences into fragments at this token: its spelling, its id, or 'eos'",
    )
    parser.add_argument("--max-fragments", type=int, default=1)
    parser.add_argument("--validation", type=float, default=0.05, help="held-out share")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="write the losses here (JSON)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    with shardcache.open_cache(args.cache) as cache:
        built_with = cache.manifest["tokenizer"]
    tokenizer = args.tokenizer or built_with["path"]
    split_token: int | str | None = args.split_token
    if split_token == "eos":  # the EOS the cache's documents end with (files joined by it)
        split_token = int(built_with["eos_id"])
    elif split_token is not None and split_token.isdigit():
        split_token = int(split_token)
    fim = FIM.from_tokenizer(
        tokenizer, args.fim_rate, args.spm_rate, split_token=split_token,
        max_fragments=args.max_fragments,
    )  # fmt: skip
    splits = Split(validation=args.validation)
    batches = {"mode": "pack", "seq_len": args.seq_len, "transform": fim, "splits": splits}
    loader = shardcache.loader(
        args.cache, args.max_tokens, attention="mask", seed=args.seed, split="train",
        num_workers=args.num_workers, device=device, **batches,
    )  # fmt: skip
    held_out = ShardDataset(args.cache, args.max_tokens, attention="mask", seed=args.seed,
                            split="validation", eval=True, **batches)  # fmt: skip
    model = tiny_model(int(built_with["vocab_size"]), args.hidden, args.seq_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    growth = loader.dataset.options.growth
    print(
        f"FIM rate {fim.rate} (SPM {fim.spm_rate}), {growth} tokens reserved a sequence; "
        f"{len(loader)} training and {len(held_out)} validation batches",
        flush=True,
    )
    eval_losses = [(0, evaluate(model, held_out, device))]
    print(f"step 0: validation loss {eval_losses[-1][1]:.4f}", flush=True)
    losses: list[float] = []
    fim_rows = rows = 0
    epoch, step, started = 0, 0, time.perf_counter()
    with loader:
        while step < args.steps:
            loader.set_epoch(epoch)
            for batch in loader:
                loss = model(**shardcache.model_inputs(batch)).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if not math.isfinite(losses[-1]):
                    raise SystemExit(f"step {step + 1}: loss is {losses[-1]}")
                fim_rows += int((batch["input_ids"] == fim.prefix_id).any(dim=1).sum())
                rows += int(batch["input_ids"].shape[0])
                step += 1
                if step % args.eval_every == 0 or step == args.steps:
                    eval_losses.append((step, evaluate(model, held_out, device)))
                    rate = step / (time.perf_counter() - started)
                    print(f"epoch {epoch} step {step}: loss {losses[-1]:.4f}, validation loss "
                          f"{eval_losses[-1][1]:.4f} ({rate:.1f} steps/s)", flush=True)  # fmt: skip
                if step == args.steps:
                    break
            else:
                epoch += 1
    report = {
        "losses": losses,
        "eval_losses": eval_losses,
        "growth": growth,
        "fim_rows": fim_rows,
        "rows": rows,
    }
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
