"""One rank of a logged training run, for tests/test_rewind_ddp.py (run by torchrun).

    python -m torch.distributed.run --nproc_per_node 2 tests/rewind_ranks.py ROOT OUT STEPS

Trains a stand-in model under DDP (gloo, CPU) for ``STEPS`` optimizer steps of gradient
accumulation ``GRAD_ACCUM`` over a mixture of the caches ``ROOT/text_a`` and ``ROOT/text_b``
(its ``train`` side of a held-out split, FIM applied), read through a DataLoader with 2
persistent workers, epoch after epoch. Every micro-batch the model received is logged by
``(step, micro)`` to ``OUT/rank<r>.pt`` (tensors and ``meta``); rank 0 writes the run record to
``OUT`` at the start and again at the end, as a recipe does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from shardcache import FIM, ShardDataset, Source, Split, write_run_record

GRAD_ACCUM = 2
MAX_TOKENS = 256


def make(root: str) -> ShardDataset:
    """The run's reader (rank and world size from torch.distributed)."""
    sources = [
        Source(os.path.join(root, "text_a"), weight=0.7, name="a", max_repetitions=2),
        Source(os.path.join(root, "text_b"), weight=0.3, name="b", max_repetitions=2),
    ]
    return ShardDataset(sources, max_tokens=MAX_TOKENS, split="train",
                        splits=Split(validation=0.15),
                        transform=FIM(0.5, 5, 6, 7, spm_rate=0.5))  # fmt: skip


def stream(ds: ShardDataset) -> Iterator[dict[str, Any]]:
    """The rank's batches through the epochs (``len`` asked each epoch, as trainers do)."""
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="forkserver")  # fmt: skip
    while True:
        assert len(loader) > 0
        yield from loader
        ds.set_epoch(ds.epoch + 1)


class TinyLM(torch.nn.Module):
    """An embedding and its tied output: enough for DDP to all-reduce a gradient."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ids = input_ids.long() % self.embed.num_embeddings
        logits = self.embed(ids) @ self.embed.weight.T
        targets = labels[:, 1:].long()
        targets = torch.where(targets >= 0, targets % self.embed.num_embeddings, targets)
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100
        )


def main() -> None:
    root, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM(64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log: dict[tuple[int, int], dict[str, Any]] = {}
    with make(root) as ds:
        if rank == 0:
            write_run_record(out, ds, grad_accum=GRAD_ACCUM)
        batches = stream(ds)
        for step in range(steps):
            for micro in range(GRAD_ACCUM):
                batch = next(batches)
                log[(step, micro)] = batch
                sync = micro == GRAD_ACCUM - 1
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = model(batch["input_ids"], batch["labels"]) / GRAD_ACCUM
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if rank == 0:  # (again: with every epoch's batch counts and stream length)
            write_run_record(out, ds, grad_accum=GRAD_ACCUM)
    torch.save(log, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
