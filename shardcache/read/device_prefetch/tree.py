"""Batch structure: flatten a nested batch to its tensors, rebuild it, pack tensors in one buffer.

Handles dicts, Mappings, lists, tuples, namedtuples and dataclasses; non-tensor values come back
as the same object. The prefetcher's pinned slots and a pickled ``Batch`` both pack this way.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: Offsets of packed tensors are multiples of this: every dtype view is legal and device kernels
#: get aligned loads. The padding costs < 256 bytes per tensor.
PACK_ALIGN = 256


def packed_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Aligned byte offsets of tensors packed in order, and the bytes needed."""
    offsets = []
    used = 0
    for t in tensors:
        offsets.append(used)
        used += -(-(t.numel() * t.element_size()) // PACK_ALIGN) * PACK_ALIGN
    return offsets, used


def packed_view(
    buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """A view of a tensor packed into ``buffer`` at ``offset``: writing it writes the buffer."""
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[offset : offset + nbytes].view(dtype).view(tuple(shape))


def flatten(obj: Any, leaves: list[torch.Tensor]) -> tuple:
    """A batch's structure without its tensors, which are appended to ``leaves`` in order."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return ("t", len(leaves) - 1)
    if isinstance(obj, Mapping):
        return ("map", obj, tuple((k, flatten(v, leaves)) for k, v in obj.items()))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("ntuple", type(obj), tuple(flatten(v, leaves) for v in obj))
    if isinstance(obj, (list, tuple)):
        return ("seq", type(obj), tuple(flatten(v, leaves) for v in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = tuple(
            (f.name, flatten(getattr(obj, f.name), leaves)) for f in dataclasses.fields(obj)
        )
        return ("dc", obj, fields)
    return ("const", obj)


def unflatten(spec: tuple, leaves: list[Any]) -> Any:
    """A batch rebuilt from ``flatten``'s spec around new leaves."""
    kind = spec[0]
    if kind == "t":
        return leaves[spec[1]]
    if kind == "const":
        return spec[1]
    if kind == "map":
        obj, items = spec[1], spec[2]
        values = {k: unflatten(s, leaves) for k, s in items}
        if type(obj) is dict:
            return values
        if isinstance(obj, dict):  # dict subclass: keep the type and its extra state
            new = copy.copy(obj)
            new.update(values)
            return new
        try:
            return type(obj)(values)
        except TypeError:
            return values
    if kind == "ntuple":
        return spec[1](*(unflatten(s, leaves) for s in spec[2]))
    if kind == "seq":
        typ, items = spec[1], [unflatten(s, leaves) for s in spec[2]]
        return items if typ is list else (tuple(items) if typ is tuple else typ(items))
    # dataclass: a shallow copy keeps non-init fields and works for frozen classes too
    new = copy.copy(spec[1])
    for name, s in spec[2]:
        object.__setattr__(new, name, unflatten(s, leaves))
    return new


def cast_tree(batch: Any, cast: Mapping[torch.dtype, torch.dtype]) -> Any:
    """A batch with the tensors of ``cast``'s source dtypes converted."""
    leaves: list[torch.Tensor] = []
    spec = flatten(batch, leaves)
    return unflatten(spec, [t.to(cast[t.dtype]) if t.dtype in cast else t for t in leaves])
