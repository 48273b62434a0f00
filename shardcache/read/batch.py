"""A batch as the reader yields it: a dict of model inputs plus ``"meta"``, as tensors.

The collators build numpy arrays; ``to_batch`` makes them tensors sharing their memory. A
``Batch`` pickles all its tensors as one storage (one shared-memory segment on a DataLoader
worker's queue), and a DataLoader left at ``batch_size=1`` is refused when it collates one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardcache.errors import ConfigError
from shardcache.read.device_prefetch.tree import packed_offsets, packed_view
from shardcache.store.columns import TOKEN_COLUMNS

#: The integer types ``ShardDataset(ids_dtype=...)`` delivers ids in.
IDS_DTYPES = ("int32", "int64")


class Batch(dict):  # type: ignore[type-arg]
    """One batch: a ``dict`` of model inputs plus ``"meta"``.

    A ``dict`` subclass so that a DataLoader left at ``batch_size=1`` fails loudly, and so that it
    pickles all its tensors as one storage (one shared-memory segment on a worker's queue).
    """

    def __copy__(self) -> Batch:
        return Batch(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        meta = self.get("meta")
        parts = {False: dict(self), True: dict(meta) if isinstance(meta, dict) else {}}
        keys = [(m, k) for m, part in parts.items() for k, v in part.items() if torch.is_tensor(v)]
        tensors = [parts[m][k] for m, k in keys]
        if not tensors or not all(_packable(t) for t in tensors):
            return super().__reduce_ex__(protocol)
        offsets, used = packed_offsets(tensors)
        flat = torch.empty(used, dtype=torch.uint8)
        specs = []
        for t, at in zip(tensors, offsets):
            packed_view(flat, at, t.dtype, t.shape).copy_(t)
            specs.append((at, t.dtype, tuple(t.shape)))
        for m, k in keys:
            parts[m][k] = None  # a placeholder keeping the key's place: rebuilt from flat
        if isinstance(meta, dict):
            parts[False]["meta"] = parts[True]
        return _rebuild_batch, (flat, specs, keys, parts[False])


def _packable(t: torch.Tensor) -> bool:
    """Whether a pickled ``Batch`` can carry ``t`` in its one storage (CPU, strided, no grad)."""
    return t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad


def _rebuild_batch(
    flat: torch.Tensor,
    specs: list[tuple[int, torch.dtype, tuple[int, ...]]],
    keys: list[tuple[bool, str]],
    items: dict[str, Any],
) -> Batch:
    """A pickled ``Batch`` again: its tensors are views of the one ``flat`` storage."""
    batch = Batch(items)
    meta = batch.get("meta")
    for (in_meta, key), (at, dtype, shape) in zip(keys, specs):
        (meta if in_meta else batch)[key] = packed_view(flat, at, dtype, shape)
    return batch


def to_batch(arrays: dict[str, Any], meta: dict[str, Any]) -> Batch:
    """The numpy arrays of a collated batch as tensors sharing their memory."""
    batch = Batch()
    for key, value in arrays.items():
        batch[key] = torch.from_numpy(value) if type(value) is np.ndarray else value
    for key, value in meta.items():
        if type(value) is np.ndarray:
            meta[key] = torch.from_numpy(value)
    batch["meta"] = meta
    return batch


def mark_filler(batch: Batch, filler: bool) -> None:
    """Flag an evaluation batch in ``meta["filler"]``; a filler's labels are all -100.

    Its per-token columns (``loss_weights``) all hold their ``fill``, as wherever labels are -100.
    """
    if filler:
        batch["labels"] = torch.full_like(batch["labels"], -100)
        for spec in TOKEN_COLUMNS.values():
            if spec.batch_key in batch:
                batch[spec.batch_key] = torch.full_like(batch[spec.batch_key], spec.fill)
    batch["meta"]["filler"] = torch.tensor(filler)


def mark_padding(batch: Batch, pad_id: int) -> None:
    """Read a batch as padding: every id ``pad_id``, no sample (ids -1), a filler (``mark_filler``).

    What a batch whose every document was excluded is (``read/exclusion.py``): its shape kept,
    nothing of its documents left in it, no trainable token.
    """
    batch["input_ids"] = torch.full_like(batch["input_ids"], pad_id)
    meta = batch["meta"]
    for key in ("sample_ids", "sample_offsets", "source_ids", "pair_ids"):
        if torch.is_tensor(meta.get(key)):
            meta[key] = torch.full_like(meta[key], -1)
    if "num_tokens" in meta:
        tokens = meta["num_tokens"]
        meta["num_tokens"] = torch.zeros_like(tokens) if torch.is_tensor(tokens) else 0
    mark_filler(batch, True)


def _refuse_collate(batches: list[Batch], **_: Any) -> Batch:
    """Refuse a DataLoader with ``batch_size`` set: it would stack already whole batches."""
    raise ConfigError(
        f"DataLoader: it collated {len(batches)} ShardDataset batch(es) into one (its "
        "batch_size defaults to 1, which adds a leading dimension to every tensor). "
        "ShardDataset yields whole token-budget batches: use DataLoader(ds, batch_size=None), "
        "or shardcache.loader(path, ...), which configures it"
    )


def _register_collate_guard() -> None:
    # torch documents extending default_collate by editing default_collate_fn_map in place;
    # an exact-type entry wins over its generic Mapping rule. Absent (another torch): the
    # README and docstrings remain the guard.
    try:
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:  # pragma: no cover - depends on the torch version
        return
    default_collate_fn_map[Batch] = _refuse_collate


_register_collate_guard()
