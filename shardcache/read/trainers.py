"""ShardDataset under the trainers that wrap DataLoaders: accelerate's wrappers are refused.

ShardDataset splits itself over ranks, so a wrapper that splits again loses data: accelerate's
``DataLoaderDispatcher`` (its default for an IterableDataset, and so transformers' ``Trainer``'s)
reads every batch on rank 0 and slices it across the ranks, and its ``IterableDatasetShard``
(``dispatch_batches=False``) keeps one of every ``num_processes`` items each rank reads. Both call
the dataset's ``set_epoch`` / ``__len__`` / ``__iter__`` on every rank before the first batch, so
``refuse_accelerate_wrapper``, called there, finds the wrapper among the callers and refuses at
start. accelerate is never imported here: without it in ``sys.modules`` there is nothing to find.
"""

from __future__ import annotations

import sys
from types import FrameType

from shardcache.errors import ConfigError

#: How many callers are searched for a wrapper (the dispatcher's ``__len__`` is the third).
MAX_FRAMES = 8

#: The accelerate wrappers that split an IterableDataset again, and what each does to it.
WRAPPERS = {
    "DataLoaderDispatcher": (
        "it reads every batch on rank 0 and slices it across the ranks (dispatch_batches, "
        "accelerate's default for an IterableDataset and so transformers' Trainer's), so the "
        "other ranks' shares are never read and the per-segment meta is cut"
    ),
    "IterableDatasetShard": (
        "it keeps one of every num_processes items a rank reads (dispatch_batches=False), so "
        "every rank trains on a fraction of its share"
    ),
}

FIX = (
    "ShardDataset already gives every rank its own batches: hand accelerate the ShardLoader "
    "that shardcache.loader(...) returns instead of a DataLoader (accelerator.prepare returns it "
    "unchanged; pass device=accelerator.device to move the batches), and with transformers' "
    "Trainer use shardcache.integrations.hf.ShardTrainer, which returns it from "
    "get_train_dataloader"
)


def accelerate_wrapper(frame: FrameType | None) -> str | None:
    """The name of the accelerate wrapper among ``frame`` and its callers, or None."""
    module = sys.modules.get("accelerate.data_loader")
    if module is None:
        return None
    classes = {name: getattr(module, name, None) for name in WRAPPERS}
    found = {name: cls for name, cls in classes.items() if isinstance(cls, type)}
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None:
            # type(), not isinstance: accelerate's loaders report DataLoader as their __class__
            for name, cls in found.items():
                if issubclass(type(owner), cls):
                    return name
        frame = frame.f_back
    return None


def refuse_accelerate_wrapper(where: str, rank: int, world_size: int) -> None:
    """Raise ConfigError when an accelerate wrapper is the caller's caller (see the module)."""
    # frame 0: here; 1: the ShardDataset method; 2 on: whoever called it
    name = accelerate_wrapper(sys._getframe(2))
    if name is None:
        return
    raise ConfigError(
        f"{where} (rank {rank} of {world_size}) is being read through accelerate's {name}: "
        f"{WRAPPERS[name]}. {FIX}"
    )
