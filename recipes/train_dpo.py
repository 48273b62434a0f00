#!/usr/bin/env python3
"""Train a causal LM with DPO on a preference cache: pair batches, a frozen reference model.

    shardcache build recipes/dpo.toml                       # 591 bundled pairs -> dpo-cache
    python recipes/train_dpo.py dpo-cache                   # 60 steps, about a minute on 2 cores
    python recipes/train_dpo.py dpo-cache --steps 30 --save-state reader.json   # stop ...
    python recipes/train_dpo.py dpo-cache --steps 20 --resume reader.json       # ... continue
    python recipes/train_dpo.py dpo-cache --overfit-batch --steps 20   # sanity check
    python recipes/train_dpo.py dpo-cache --mode pack --seq-len 256 --steps 50  # packed pairs

What it shows (copy it):

* ``ShardDataset(cache, max_tokens)`` on a preference cache. Pad mode (the default): rows
  ``2j`` and ``2j + 1`` of a batch are pair ``j``'s chosen and rejected sequence (prompt +
  completion). Pack mode (``--mode pack --seq-len N``, ``--attention mask`` by default): a
  pair's two sequences are adjacent whole segments of one row, several pairs a row, kept
  apart by ``position_ids`` and a block-diagonal ``attention_mask`` (or the varlen keys).
  Either way ``labels`` hold the completion tokens and ``-100`` elsewhere;
* :func:`pair_logps`: ``shardcache.integrations.hf.causal_lm_pair_logps``, one forward over
  the batch's model inputs, then per pair the summed log-probs of its chosen and of its
  rejected completion, the same numbers in both modes (tests/test_recipes.py checks it). The
  output layer is applied to a chunk of ``--chunk-tokens`` completion positions at a time
  (default: sized from the vocabulary; 0: the model's whole logits), so a 151k vocabulary
  does not take gigabytes of logits, forward or backward;
* the reference model is a frozen copy of the policy at step 0: its log-probs are computed
  once per batch, under ``torch.no_grad()``, before the policy's forward;
* :func:`dpo_loss`: the sigmoid DPO loss ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r -
  ref_r)))`` averaged over the batch's pairs, as TRL's ``DPOTrainer`` computes it
  (``loss_type="sigmoid"``; tests/test_dpo_trl.py checks the two agree on the same records,
  pad and pack mode).

At step 0 the policy is the reference, so the loss is ``ln 2`` for every pair; it falls as the
policy learns to prefer the chosen side. The model is a small random Qwen2 or Llama sized from
the cache's vocabulary (``--vocab-size``: a larger one, e.g. Qwen2's 151,936, to size memory):
a stand-in, what is measured is the loss and the reward accuracy. Progress is printed every
``--log-every`` steps (and after the first).
``--report PATH`` writes per-step losses, accuracies and the pair ids of every batch (JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import shardcache
from shardcache.integrations.hf import causal_lm_pair_logps


def tiny_model(
    vocab_size: int,
    hidden: int = 64,
    max_positions: int = 1024,
    arch: str = "qwen2",
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A 2-layer random Qwen2 or Llama (from a config: nothing downloaded)."""
    heads = max(1, hidden // 32)
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
    }
    if arch == "qwen2":
        return Qwen2ForCausalLM._from_config(Qwen2Config(**common),
                                             attn_implementation=attn_implementation)  # fmt: skip
    if arch == "llama":
        return LlamaForCausalLM._from_config(LlamaConfig(**common),
                                             attn_implementation=attn_implementation)  # fmt: skip
    raise SystemExit(f"--arch: got {arch!r}; use qwen2 or llama")


def pair_logps(
    model: torch.nn.Module, batch: dict[str, Any], chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair of the batch, the summed log-probs of its chosen and rejected completion.

    One forward over the batch as ``ShardDataset`` gives it (pad rows, or packed rows with
    their ``position_ids`` and ``attention_mask`` / varlen keys), then the output layer over
    the completion positions, ``chunk_tokens`` at a time: entry ``k`` of both tensors is the
    ``k``-th pair of ``meta["pair_ids"][meta["side"] == 0]`` (``shardcache.pair_logps`` of the
    model's logits, without holding them whole).
    """
    return causal_lm_pair_logps(model, batch, chunk_tokens)


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, the sigmoid DPO loss and the log-ratio difference ``delta``.

    ``loss = -log sigmoid(beta * delta)``, ``delta = (pi_c - ref_c) - (pi_r - ref_r)``.
    """
    delta = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -F.logsigmoid(beta * delta), delta


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The sigmoid DPO loss of a batch's pairs (one value per pair each), mean over pairs.

    Returns the loss and the batch's metrics: ``accuracy`` (pairs whose chosen reward beats
    the rejected one) and ``margin`` (mean chosen minus rejected reward, ``beta`` times the
    log-ratios).
    """
    losses, delta = dpo_losses(
        policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta
    )
    with torch.no_grad():
        metrics = {
            "accuracy": (delta > 0).float().mean().item(),
            "margin": (beta * delta).mean().item(),
        }
    return losses.mean(), metrics


def batch_pairs(batch: dict[str, Any]) -> np.ndarray:
    """The batch's pair ids, in the order of ``pair_logps``' values (its ``side == 0`` entries).

    Checks what the pairing relies on: a pair's chosen and rejected sequence come in the same
    order (pad rows ``2j``, ``2j + 1``; pack segments ``k``, ``k + 1``), padding aside.
    """
    meta = batch["meta"]
    side, pairs = meta["side"].cpu().numpy(), meta["pair_ids"].cpu().numpy()
    chosen, rejected = pairs[side == 0], pairs[side == 1]
    if not len(chosen) or not np.isin(side, (-1, 0, 1)).all():
        raise SystemExit("batch holds no chosen/rejected pairs: is the cache a preference one?")
    if len(chosen) != len(rejected) or (chosen != rejected).any():
        raise SystemExit("batch: the chosen and rejected sequences are not of the same pairs")
    return chosen


def main(argv: list[str] | None = None) -> dict:
    """Run DPO on a preference cache; returns losses, accuracies, pair ids and reader state."""
    parser = argparse.ArgumentParser(description="DPO over a shardcache preference cache")
    parser.add_argument("cache")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to run")
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget per batch")
    parser.add_argument(
        "--mode", choices=["pad", "pack"], default="pad",
        help="pad: a sequence per row; pack: whole pairs packed into rows of --seq-len",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=int, default=None,
        help="pack mode: row length (default: the longest pair, rounded up to 64)",
    )  # fmt: skip
    parser.add_argument(
        "--attention", choices=["mask", "varlen"], default="mask",
        help="pack mode: how segments are kept apart (mask: 4-D mask, any attention "
        "implementation; varlen: cu_seqlens keys, for flash attention)",
    )  # fmt: skip
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the model's vocabulary (default: the cache's tokenizer's)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="positions whose logits are computed at once (default: sized from "
                        "the vocabulary; 0: the model's whole logits)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--resume", help="reader state JSON written by --save-state")
    parser.add_argument("--save-state", help="write the reader state after the last step")
    parser.add_argument(
        "--overfit-batch", action="store_true", help="train on the first batch over and over"
    )
    parser.add_argument("--report", help="write losses and consumed pair ids here (JSON)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    cache = shardcache.open_cache(args.cache)
    if not cache.is_preference:
        raise SystemExit(f"{args.cache}: not a preference cache (build it with --preference)")
    lengths = np.asarray(cache.lengths, dtype=np.int64)
    longest = int(lengths.max())
    packing: dict[str, Any] = {}
    if args.mode == "pack":  # a pair's two sequences are adjacent segments of one row
        pair_longest = int((lengths[0::2] + lengths[1::2]).max())
        seq_len = args.seq_len or -(-pair_longest // 64) * 64
        packing = {"mode": "pack", "seq_len": seq_len, "attention": args.attention}
        longest = max(longest, seq_len)  # a row's padding segment counts positions too
    loader = shardcache.loader(args.cache, args.max_tokens, seed=args.seed,
                               num_workers=args.num_workers, device=device, **packing)  # fmt: skip
    if args.resume:
        with open(args.resume, encoding="utf-8") as f:
            loader.load_state_dict(json.load(f))
    vocab = int(cache.manifest["tokenizer"]["vocab_size"])
    if args.vocab_size is not None:
        if args.vocab_size < vocab:
            parser.error(f"--vocab-size {args.vocab_size} is below the cache's vocabulary, {vocab}")
        vocab = args.vocab_size
    policy = tiny_model(vocab, args.hidden, max(longest, 64), args.arch).to(device).train()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # frozen, the step-0 policy
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    print(
        f"model: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters "
        f"({args.arch}, vocab {vocab}); {cache.num_sequences // 2} pairs, "
        f"{len(loader)} batches per epoch ({args.mode} mode"
        + (f", seq_len {packing['seq_len']}, attention {args.attention}" if packing else "")
        + f"); beta {args.beta}",
        flush=True,
    )

    losses: list[float] = []
    accuracies: list[float] = []
    consumed: list[list[int]] = []
    reference_forwards = 0
    epoch, step, started = loader.dataset.epoch, 0, time.perf_counter()
    first: tuple[dict[str, Any], np.ndarray, tuple[torch.Tensor, torch.Tensor]] | None = None
    with loader:
        while step < args.steps:
            loader.set_epoch(epoch)
            for batch in loader:
                if args.overfit_batch and first is not None:
                    batch, pairs, ref = first  # the reference log-probs of the batch, kept
                else:
                    pairs = batch_pairs(batch)
                    with torch.no_grad():  # once per batch: the reference never changes
                        ref = pair_logps(reference, batch, args.chunk_tokens)
                    reference_forwards += 1
                    first = first if first is not None else (batch, pairs, ref)
                logps = pair_logps(policy, batch, args.chunk_tokens)
                loss, metrics = dpo_loss(*logps, *ref, args.beta)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                accuracies.append(metrics["accuracy"])
                consumed.append(pairs.tolist())
                step += 1
                if not math.isfinite(losses[-1]):
                    raise SystemExit(f"step {step}: loss is {losses[-1]}")
                if step % args.log_every == 0 or step in (1, args.steps):
                    rate = step / (time.perf_counter() - started)
                    print(f"epoch {epoch} step {step}: loss {losses[-1]:.4f} accuracy "
                          f"{metrics['accuracy']:.2f} margin {metrics['margin']:.3f} "
                          f"({rate:.1f} steps/s)", flush=True)  # fmt: skip
                if step == args.steps:
                    break
            else:
                epoch += 1
        state = loader.state_dict()  # exact: counts only the batches trained on
    if args.save_state:
        with open(args.save_state, "w", encoding="utf-8") as f:
            json.dump(state, f)
    report = {
        "losses": losses,
        "accuracies": accuracies,
        "pairs": consumed,
        "reference_forwards": reference_forwards,
        "state": state,
    }
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
