#!/usr/bin/env python3
"""Train a stand-in model with DDP from a shardcache cache: the reader under torchrun, measured.

    torchrun --nproc_per_node 2 recipes/train_ddp.py CACHE
    torchrun --nproc_per_node 2 recipes/train_ddp.py CACHE --mode pack --seq-len 512 \\
        --num-workers 2 --epochs 2 --report report.json
    torchrun --nproc_per_node 2 recipes/train_ddp.py CACHE --max-steps 20   # a short run

CPU + gloo without a GPU, GPU + nccl with one (one device per rank). What it measures: the
data path under DDP (steps per second, tokens per second per rank, and how long the step waited
for its batch), and that every rank takes the same number of steps. The model is a stand-in:
an embedding and one MLP, no attention (so packed documents cannot see each other and
``attention="none"`` is exact here; a real transformer needs ``"mask"`` or ``"varlen"``, see
recipes/train_loop.py). Its output layer has at most ``--model-vocab`` classes (default 8192):
token ids are folded into that range (``id % classes``). The logits are tokens x classes x 4
bytes, three times over with softmax and gradient: with a 151k vocabulary and 4096-token
batches that was 5.9 GB RSS per rank and ~10 s per step, which measured the output layer, not
the reader (a 9.8 M-parameter model with the full 151k output on 2 x 2,048-token rows peaked
at 8 GB, the reader at 385 MB). ``--max-steps N`` ends the run after N steps (every rank at the
same one), within an epoch if need be. What it shows:

* ``shardcache.loader(...)``: ``ShardDataset`` reads rank and world size from
  torch.distributed; every rank yields the same number of batches per epoch, so DDP never
  waits at the end of an epoch; DataLoader workers started with forkserver (a fork of a process
  that runs the process group's threads aborted a rank at exit about once in ten CI runs);
  ``batch_size=None``; the stream of a rank is the same for any ``--num-workers``;
* the ``DevicePrefetcher`` it adds with ``device=`` moves batches to the device (a
  pass-through on CPU);
* ``set_epoch`` reshuffles each epoch; ``len(loader)`` is known before the epoch (LR schedules);
* checkpointing the reader: ``loader.state_dict()`` after ``k`` steps (exact with workers and a
  prefetcher), ``--resume STATE`` to continue from such a state, with any world size;
* the run record (``--run-record DIR``, or beside ``--save-state``): written at the end with
  the ``shardcache rewind DIR --step N`` command for the last step (docs/guide/loss-spikes.md).

Where each step waits: a ``shardcache.StallMonitor`` around the loader (one all-reduce of two
numbers per step for the slowest and fastest rank's wait); the progress line (rank 0) shows the
share of the steps since the previous line spent waiting for data and the slowest / fastest
rank's wait; ``--tensorboard DIR`` writes every step's figures there (rank 0; needs
tensorboard).

Progress is printed every ``--log-every`` steps (rank 0). ``--report PATH`` writes (rank 0,
JSON) the steps per rank and epoch and the segments every rank consumed
(``[sample_id, offset, length]``), and each rank's summed data-loading figures, so a test can
check equal steps and exact coverage.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import shardcache

#: The most output classes of the stand-in model (see the module docstring).
MODEL_VOCAB = 8192


class TinyLM(torch.nn.Module):
    """Embedding + one MLP + tied output over ``classes`` folded token ids: a stand-in whose
    cost stays small whatever the tokenizer's vocabulary."""

    def __init__(self, classes: int, dim: int = 64):
        super().__init__()
        self.classes = classes
        self.embed = torch.nn.Embedding(classes, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.mlp(self.embed(input_ids % self.classes))
        logits = hidden @ self.embed.weight.T
        # labels are aligned with input_ids (Hugging Face convention): shift here
        targets = labels[:, 1:].reshape(-1)
        targets = torch.where(targets >= 0, targets % self.classes, targets)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets, reduction="sum"
        )
        return loss / (targets != -100).sum().clamp(min=1)  # a batch may have no targets


def segments(batch: dict) -> list[list[int]]:
    """``[sample_id, offset, length]`` of every real row/segment of a (CPU) batch."""
    meta = batch["meta"]
    if "cu_seqlens" in meta:
        bounds = meta["cu_seqlens"].tolist()
        ids, offsets = meta["sample_ids"].tolist(), meta["sample_offsets"].tolist()
        return [
            [s, o, bounds[k + 1] - bounds[k]]
            for k, (s, o) in enumerate(zip(ids, offsets))
            if s >= 0
        ]
    lengths = batch["attention_mask"].sum(1).tolist()
    return [[s, 0, n] for s, n in zip(meta["sample_ids"].tolist(), lengths)]


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP training through ShardDataset")
    parser.add_argument("cache")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--mode", choices=["pad", "pack"], default="pad")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--packing", choices=["best_fit", "concat"], default="best_fit")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many steps in all (every rank at the same step; "
                        "the saved state is there), even within an epoch")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", help="a reader state JSON written by --save-state")
    parser.add_argument("--save-state", help="write the reader state here at the end (rank 0)")
    parser.add_argument("--report", help="write steps and consumed segments here (rank 0)")
    parser.add_argument("--run-record",
                        help="write the run record into this folder at the end (rank 0; default: "
                        "the folder of --save-state) and print the rewind command")  # fmt: skip
    parser.add_argument("--log-every", type=int, default=10, help="print progress every N steps")
    parser.add_argument("--tensorboard", help="write the data-loading figures here (rank 0)")
    parser.add_argument("--model-vocab", type=int, default=MODEL_VOCAB,
                        help="at most this many output classes (token ids are folded)")  # fmt: skip
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
        batch_options["attention"] = "none"  # TinyLM has no attention: nothing to mask
    loader = shardcache.loader(args.cache, args.max_tokens, seed=args.seed, device=device,
                               num_workers=args.num_workers, **batch_options)  # fmt: skip
    ds = loader.dataset
    first_epoch = 0
    if args.resume:
        with open(args.resume, encoding="utf-8") as f:
            loader.load_state_dict(json.load(f))
        first_epoch = ds.epoch

    vocab = int(shardcache.open_cache(args.cache).manifest["tokenizer"]["vocab_size"])
    classes = min(vocab, args.model_vocab)
    model = DistributedDataParallel(
        TinyLM(classes).to(device), device_ids=[device.index] if use_cuda else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if rank == 0:
        print(
            f"world {world} on {device.type}; {ds.batches_per_rank()} batches per rank per "
            f"epoch; stand-in model: vocab {vocab} folded to {classes} classes",
            flush=True,
        )
        print(f"tail: {ds.tail_report()}", flush=True)
        print("measuring: steps/s, tokens/s per rank, time the step waited for its batch",
              flush=True)  # fmt: skip

    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)
    # step() is a collective (max / min over the ranks): every rank calls it once per step
    monitor = shardcache.StallMonitor(writer, prefix="data/")
    loading: dict[str, float] = {}  # this rank's figures summed over its steps
    window: dict[str, float] = {}  # rank 0's since the last progress line

    consumed: list[list[int]] = []
    state = loader.state_dict()
    steps_per_epoch: list[int] = []
    budget = args.max_steps  # steps left: every rank takes the same count per epoch
    with loader:
        for epoch in range(first_epoch, args.epochs):
            if budget is not None and budget <= 0:
                break
            loader.set_epoch(epoch)  # same epoch after --resume: keeps the resumed position
            expected, steps, tokens = len(loader), 0, 0
            started = time.perf_counter()
            for batch in monitor.wrap(loader):
                if args.report:
                    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
                    cpu["meta"] = {k: v.cpu() if torch.is_tensor(v) else v
                                   for k, v in batch["meta"].items()}  # fmt: skip
                    consumed += segments(cpu)
                loss = model(batch["input_ids"], batch["labels"])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # all-reduce: every rank must take the same number of steps
                optimizer.step()
                steps += 1
                tokens += int((batch["labels"] != -100).sum())
                figures = monitor.step()
                for name, value in figures.items():
                    loading[name] = loading.get(name, 0.0) + value
                    window[name] = window.get(name, 0.0) + value
                if rank == 0 and (steps % args.log_every == 0 or steps == expected):
                    elapsed = time.perf_counter() - started
                    pct = 100 * window["data_loading_s"] / max(window["step_s"], 1e-9)
                    print(
                        f"epoch {epoch} step {steps}/{expected}: loss {loss.item():.3f}, "
                        f"{steps / elapsed:.1f} steps/s, {tokens / elapsed:,.0f} trained "
                        f"tokens/s (rank 0), waited for data {pct:.1f}% of the time "
                        f"(slowest rank {window.get('data_loading_max_s', 0.0):.3f}s, fastest "
                        f"{window.get('data_loading_min_s', 0.0):.3f}s)",
                        flush=True,
                    )
                    window = {}
                if budget is not None and steps == budget:
                    break  # the loader's state is exact after a break too
            if budget is not None:
                budget -= steps
            assert steps == expected or budget == 0, (steps, expected)
            steps_per_epoch.append(steps)
            state = loader.state_dict()  # exact even with workers and a prefetcher

    if writer is not None:
        writer.close()
    if args.save_state and rank == 0:
        with open(args.save_state, "w", encoding="utf-8") as f:
            json.dump(state, f)
    folder = args.run_record or (os.path.dirname(os.path.abspath(args.save_state))
                                 if args.save_state else None)  # fmt: skip
    if folder and rank == 0:  # what `shardcache rewind` recomputes any step's batches from
        path = shardcache.write_run_record(folder, ds)
        last = ds.run_record().step_at(state["epoch"], state["consumed"]) - 1
        print(f"run record: {path}; the batches of the last step ({last}): "
              f"shardcache rewind {folder} --step {last}", flush=True)  # fmt: skip
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "steps": steps_per_epoch,
                                      "segments": consumed, "data_loading": loading})  # fmt: skip
    if args.report and rank == 0:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump({"world_size": world, "ranks": gathered, "tail": ds.tail_report()}, f)
    dist.barrier()  # no rank tears the process group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
