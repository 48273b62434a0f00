"""Per-token columns beside ``tokens`` and ``mask``: one spec each, read generically.

A ``TokenColumn`` says everything the store and the read side need to carry a column of one
value per token: its shard column and dtype, the value padding and untrainable slots get, the
value a source without it gets where it trains, the manifest fact that says a cache stores it,
its name in batches and exports, how ``verify`` checks it and how ``show`` labels it. The shard
writer and reader, ``Cache.gather``, ``verify``, ``show``, the export, the collate layout and the
batch read ``TOKEN_COLUMNS`` and nothing else; a builder produces the values, a sample reader
gathers them. Invariants: a column's values line up with the tokens (same list offsets), and a
cache stores the columns its manifest's tokenizer facts name, in ``TOKEN_COLUMNS`` order, after
``mask``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class TokenColumn:
    """One per-token column: how it is stored, defaulted, checked, shown and delivered.

    Attributes:
        name: the shard column and the key in ``Gathered.extras``.
        dtype: the numpy dtype of its values (the Arrow list's value type follows).
        fill: the value of padding, empty slots and untrainable positions (labels -100).
        trained: the value of a trainable token of a source that does not store the column.
        manifest_fact: the key of the manifest's tokenizer facts that names the build option
            when a cache stores the column.
        build_option: the ``ChatOptions`` field whose value (not None) makes a chat build
            produce it; the build option's flag is ``build_flag``.
        build_flag: the ``build`` flag, named in errors that say how to do without the column.
        batch_key: the name of its array in batches and of its column in an ``hf`` export.
        label: what it is, plural, in messages (``"loss weights"``).
        singular: one value, in ``show``'s header and JSON runs (``"loss weight"``; the last
            word is a run's JSON key).
        tag: ``show``'s mark after a trainable run whose value is not ``trained`` (``{w=...}``).
        in_mask: the chat build hands its values to the shard writer in place of the mask (the
            stored mask is then ``values != fill``).
        check: what is wrong with a record batch's stored values given its loss mask, or None.
    """

    name: str
    dtype: np.dtype
    fill: float
    trained: float
    manifest_fact: str
    build_option: str
    build_flag: str
    batch_key: str
    label: str
    singular: str
    tag: str
    in_mask: bool
    check: Callable[[np.ndarray, np.ndarray], str | None]

    @property
    def arrow_type(self) -> pa.DataType:
        """The Arrow type of one value (a shard or export column is a list of them)."""
        return pa.from_numpy_dtype(self.dtype)

    @property
    def run_key(self) -> str:
        """The key of a run's value in ``show --json`` (the last word of ``singular``)."""
        return self.singular.split()[-1]

    def default(self, mask: np.ndarray) -> np.ndarray:
        """The values of a source without the column: ``trained`` where ``mask``, else ``fill``."""
        return np.where(mask, self.dtype.type(self.trained), self.dtype.type(self.fill)).astype(
            self.dtype, copy=False
        )


def _weights_problem(weights: np.ndarray, mask: np.ndarray) -> str | None:
    """Loss weights are finite numbers in [0, 1], > 0 exactly where the loss mask is set."""
    if len(weights) and not bool(np.all((weights >= 0) & (weights <= 1))):
        return "a loss weight outside [0, 1] (or not a number)"
    if not np.array_equal(weights > 0, mask):
        return "the loss weights are not > 0 exactly where the loss mask is set"
    return None


#: Every per-token column, by shard column name, in stored order.
TOKEN_COLUMNS: dict[str, TokenColumn] = {
    "weights": TokenColumn(
        name="weights",
        dtype=np.dtype(np.float32),
        fill=0.0,
        trained=1.0,
        manifest_fact="loss_weights",
        build_option="weight_field",
        build_flag="--weight-field",
        batch_key="loss_weights",
        label="loss weights",
        singular="loss weight",
        tag="w",
        in_mask=True,
        check=_weights_problem,
    ),
}


def stored_columns(manifest: Mapping[str, Any]) -> tuple[str, ...]:
    """The per-token columns a cache's shards store, by its manifest's tokenizer facts."""
    facts = manifest.get("tokenizer") or {}
    return tuple(name for name, c in TOKEN_COLUMNS.items() if facts.get(c.manifest_fact))


def built_columns(chat_options: Any) -> tuple[str, ...]:
    """The per-token columns a chat build with ``chat_options`` (None: not chat) writes."""
    if chat_options is None:
        return ()
    return tuple(
        name
        for name, c in TOKEN_COLUMNS.items()
        if getattr(chat_options, c.build_option, None) is not None
    )


def ordered(names: Any) -> tuple[str, ...]:
    """``names`` (any iterable of column names) in ``TOKEN_COLUMNS`` order, once each."""
    wanted = set(names)
    return tuple(name for name in TOKEN_COLUMNS if name in wanted)
