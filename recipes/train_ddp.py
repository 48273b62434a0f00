#!/usr/bin/env python3
"""Train a tiny language model with DDP from a shardcache cache.

    torchrun --nproc_per_node 2 recipes/train_ddp.py CACHE
    torchrun --nproc_per_node 2 recipes/train_ddp.py CACHE --mode pack --seq-len 512 \\
        --num-workers 2 --epochs 2 --report report.json

CPU + gloo without a GPU, GPU + nccl with one (one device per rank). What it shows:

* ``ShardDataset`` reads rank and world size from torch.distributed; every rank yields the same
  number of batches per epoch, so DDP never waits at the end of an epoch;
* ``DataLoader(ds, batch_size=None, num_workers=N)``: the stream of a rank is the same for any N;
* ``DevicePrefetcher`` moves batches to the device (a pass-through on CPU);
* ``set_epoch`` reshuffles each epoch; ``len(ds)`` is known before the epoch (LR schedules);
* checkpointing the reader: ``ds.state_dict(steps=k)`` after ``k`` steps (exact with workers and a
  prefetcher), ``--resume STATE`` to continue from such a state, with any world size.

``--report PATH`` writes (rank 0, JSON) the steps per rank and epoch and the segments every rank
consumed (``[sample_id, offset, length]``), so a test can check equal steps and exact coverage.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from shardcache import DevicePrefetcher, open_cache
from shardcache.read.dataset import ShardDataset


class TinyLM(torch.nn.Module):
    """Embedding + one MLP + tied output: enough to show the loop, not to learn much."""

    def __init__(self, vocab_size: int, dim: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.mlp(self.embed(input_ids))
        logits = hidden @ self.embed.weight.T
        # labels are aligned with input_ids (Hugging Face convention): shift here
        targets = labels[:, 1:].reshape(-1)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets, reduction="sum"
        )
        return loss / (targets != -100).sum().clamp(min=1)  # a batch may have no targets


def segments(batch: dict) -> list[list[int]]:
    """``[sample_id, offset, length]`` of every real row/segment of a (CPU) batch."""
    if "cu_seqlens" in batch:
        bounds = batch["cu_seqlens"].tolist()
        ids, offsets = batch["sample_ids"].tolist(), batch["sample_offsets"].tolist()
        return [
            [s, o, bounds[k + 1] - bounds[k]]
            for k, (s, o) in enumerate(zip(ids, offsets))
            if s >= 0
        ]
    lengths = batch["attention_mask"].sum(1).tolist()
    return [[s, 0, n] for s, n in zip(batch["sample_ids"].tolist(), lengths)]


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP training through ShardDataset")
    parser.add_argument("cache")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--mode", choices=["pad", "pack"], default="pad")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--packing", choices=["best_fit", "concat"], default="best_fit")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", help="a reader state JSON written by --save-state")
    parser.add_argument("--save-state", help="write the reader state here at the end (rank 0)")
    parser.add_argument("--report", help="write steps and consumed segments here (rank 0)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)

    batch_options = {"mode": args.mode, "packing": args.packing}
    if args.mode == "pack":
        batch_options["seq_len"] = args.seq_len or args.max_tokens
    ds = ShardDataset(args.cache, args.max_tokens, seed=args.seed, **batch_options)
    first_epoch = 0
    if args.resume:
        with open(args.resume, encoding="utf-8") as f:
            ds.load_state_dict(json.load(f))
        first_epoch = ds.epoch
    # forkserver: DataLoader workers are not forked from a process that already runs the
    # process group's (gloo/nccl) threads; a fork there aborted a rank at exit ("terminate
    # called without an active exception") about once in ten CI runs
    context = "forkserver" if args.num_workers > 0 else None
    loader = DataLoader(ds, batch_size=None, num_workers=args.num_workers, pin_memory=False,
                        multiprocessing_context=context)  # fmt: skip

    vocab = int(open_cache(args.cache).manifest["tokenizer"]["vocab_size"])
    model = DistributedDataParallel(
        TinyLM(vocab).to(device), device_ids=[device.index] if use_cuda else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if rank == 0:
        print(f"world {world}, {ds.batches_per_rank()} batches per rank per epoch", flush=True)
        print(f"tail: {ds.tail_report()}", flush=True)

    consumed: list[list[int]] = []
    state = ds.state_dict()
    steps_per_epoch: list[int] = []
    with DevicePrefetcher(loader, device=device) as batches:
        for epoch in range(first_epoch, args.epochs):
            ds.set_epoch(epoch)  # same epoch after --resume: keeps the resumed position
            expected, steps = len(ds), 0
            for batch in batches:
                if args.report:
                    consumed += segments({k: v.cpu() if torch.is_tensor(v) else v
                                          for k, v in batch.items()})  # fmt: skip
                loss = model(batch["input_ids"], batch["labels"])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # all-reduce: every rank must take the same number of steps
                optimizer.step()
                steps += 1
            assert steps == expected, (steps, expected)
            steps_per_epoch.append(steps)
            if rank == 0 and steps:
                print(f"epoch {epoch}: {steps} steps, last loss {loss.item():.3f}", flush=True)
            state = ds.state_dict(steps=steps)  # exact even with workers and a prefetcher

    if args.save_state and rank == 0:
        with open(args.save_state, "w", encoding="utf-8") as f:
            json.dump(state, f)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "steps": steps_per_epoch,
                                      "segments": consumed})  # fmt: skip
    if args.report and rank == 0:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump({"world_size": world, "ranks": gathered, "tail": ds.tail_report()}, f)
    dist.barrier()  # no rank tears the process group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
