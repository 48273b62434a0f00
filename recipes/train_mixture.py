#!/usr/bin/env python3
"""Train a causal LM on a mixture of caches read from a mixture recipe (``recipes/mixture.toml``).

    shardcache build recipes/quickstart.toml && shardcache build recipes/sft-chat.toml
    python recipes/train_mixture.py recipes/mixture.toml --steps 50
    python recipes/train_mixture.py recipes/mixture.toml --steps 20 --save-state mix.json
    python recipes/train_mixture.py recipes/mixture.toml --steps 20 --resume mix.json

What it shows (copy it):

* ``load_mixture_recipe(path)``: the ``[[source]]`` tables (path, weight, max_repetitions)
  and the batch options of the recipe; ``shardcache.loader(recipe.sources,
  **recipe.dataset_options())`` reads every source as one token-weighted stream (documents of
  all sources shuffled and packed together);
* ``loader.dataset.mixture``: what each source gives an epoch (the table ``shardcache mix``
  prints);
* ``batch["meta"]["source_ids"]``: the source of every packed segment (-1 for padding), here
  summed into the tokens each source delivered, next to the target shares;
* ``loader.state_dict()`` carries the mixture: resuming with other weights or caches is
  refused unless ``remix=True`` (``--remix``).

The model is a small random Qwen2 sized from the tokenizer's vocabulary; it is a stand-in.
``--report PATH`` writes the losses and the tokens per source (JSON).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import shardcache
from shardcache.read.selection.mixture_recipe import load_mixture_recipe


def tiny_model(vocab_size: int, hidden: int, max_positions: int) -> Qwen2ForCausalLM:
    """A 2-layer random Qwen2 (a stand-in for the model being trained)."""
    heads = max(1, hidden // 32)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")


def source_tokens(batch: dict, counts: list[int]) -> None:
    """Add the tokens of every source in ``batch`` to ``counts`` (padding left out)."""
    meta = batch["meta"]
    if "cu_seqlens" in meta:  # pack: one source id per segment
        lengths = meta["cu_seqlens"][1:] - meta["cu_seqlens"][:-1]
    else:  # pad: one per row
        lengths = batch["attention_mask"].sum(dim=1)
    sources = meta["source_ids"]
    for s in range(len(counts)):
        counts[s] += int(lengths[sources == s].sum())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="train on a mixture recipe")
    parser.add_argument("recipe", help="a mixture recipe (TOML with [[source]] tables)")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps to run")
    parser.add_argument("--num-workers", type=int, default=None, help="default: the loader's")
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--resume", help="reader state JSON written by --save-state")
    parser.add_argument("--remix", action="store_true", help="resume under another mixture")
    parser.add_argument("--save-state", help="write the reader state after the last step")
    parser.add_argument("--report", help="write losses and tokens per source here (JSON)")
    args = parser.parse_args(argv)

    recipe = load_mixture_recipe(args.recipe)
    options = recipe.dataset_options()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(int(options.get("seed", 0)))
    loader = shardcache.loader(
        recipe.sources, **options, remix=args.remix, num_workers=args.num_workers, device=device
    )
    if args.resume:
        with open(args.resume, encoding="utf-8") as f:
            loader.load_state_dict(json.load(f))
    table = loader.dataset.mixture
    print(table.format(), flush=True)
    manifest = shardcache.open_cache(recipe.sources[0].path).manifest
    vocab = int(manifest["tokenizer"]["vocab_size"])
    width = int(options.get("seq_len") or options["max_tokens"])
    model = tiny_model(vocab, args.hidden, width).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    use_cache = {"use_cache": False} if options.get("attention") == "varlen" else {}

    losses: list[float] = []
    counts = [0] * len(table.sources)
    epoch, step = loader.dataset.epoch, 0
    with loader:
        while step < args.steps:
            loader.set_epoch(epoch)  # the resumed epoch keeps its position
            for batch in loader:
                loss = model(**shardcache.model_inputs(batch), **use_cache).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                source_tokens(batch, counts)
                step += 1
                if not math.isfinite(losses[-1]):
                    raise SystemExit(f"step {step}: loss is {losses[-1]}")
                if step % args.log_every == 0 or step == args.steps:
                    total = max(sum(counts), 1)
                    shares = ", ".join(
                        f"{row.name} {n / total:.2f} (target {row.share:.2f})"
                        for row, n in zip(table.sources, counts)
                    )
                    print(f"epoch {epoch} step {step}: loss {losses[-1]:.4f}; tokens: {shares}",
                          flush=True)  # fmt: skip
                if step == args.steps:
                    break
            else:
                epoch += 1  # the pass ended: next epoch
        state = loader.state_dict()  # exact: counts only the batches trained on
    if args.save_state:
        with open(args.save_state, "w", encoding="utf-8") as f:
            json.dump(state, f)
    report = {
        "losses": losses,
        "tokens": {row.name: n for row, n in zip(table.sources, counts)},
        "mixture": table.to_json(),
        "state": state,
    }
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
