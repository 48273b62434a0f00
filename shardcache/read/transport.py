"""How a batch crosses from a DataLoader worker to the main process: one storage, not six.

What this module owns
---------------------
A DataLoader worker hands its batches to the main process by pickling them with torch's
``ForkingPickler``, which moves every tensor's storage into its own shared-memory segment and
passes one file descriptor per tensor through a socket. That costs about 0.5 ms a tensor on
the 2-core machine these numbers come from, so a packed batch (``input_ids``, ``labels``,
``position_ids`` and three ``meta`` tensors) took 2.7-3.9 ms a batch and 1.2-2.1 ms of the
main process's CPU, against ~40 us to build the batch in-process.

:func:`pack` copies the tensors of a batch into one flat byte tensor (each at a 64-byte
aligned offset) and :func:`unpack` rebuilds them as views of it, so a pickled batch moves one
storage. ``ShardDataset``'s :class:`~shardcache.read.dataset.Batch` pickles that way
(``Batch.__reduce_ex__``): a batch through workers took 1.6-2.1 ms, 0.8-1.0 ms of the main
process's CPU (2 workers, 16 x 2048 tokens, measured). Only CPU tensors with the default
strided layout and no autograd history travel so; anything else keeps torch's own pickling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Offsets of the packed tensors are multiples of this (any dtype's alignment, a cache line).
ALIGN = 64

#: One packed tensor: dtype, shape, byte offset in the flat storage, byte length.
Spec = tuple[torch.dtype, tuple[int, ...], int, int]


def packable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`pack` can carry these tensors (CPU, strided, no autograd)."""
    return all(
        t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
        for t in tensors
    )


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[Spec]]:
    """The tensors' data in one flat uint8 tensor, and where each one lies in it."""
    specs: list[Spec] = []
    at = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append((t.dtype, tuple(t.shape), at, nbytes))
        at += -(-nbytes // ALIGN) * ALIGN
    flat = torch.empty(at, dtype=torch.uint8)
    for t, (dtype, shape, offset, nbytes) in zip(tensors, specs):
        flat[offset : offset + nbytes].view(dtype).view(shape).copy_(t)
    return flat, specs


def unpack(flat: torch.Tensor, specs: Sequence[Spec]) -> list[torch.Tensor]:
    """The tensors :func:`pack` packed, as views of ``flat`` (contiguous, disjoint)."""
    return [
        flat[offset : offset + nbytes].view(dtype).view(shape)
        for dtype, shape, offset, nbytes in specs
    ]
