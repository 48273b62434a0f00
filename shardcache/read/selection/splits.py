"""Held-out splits: which documents of a cache are train, validation or test.

A split is a filter on documents before the plan. A document's side is a function of its key
(``Cache.document_keys``: its input file and record) and the split's seed and fractions only, so
every piece of a document cut by ``truncation="split"`` is on one side, and a rebuild of the same
inputs with other shard sizes, workers or bucket edges keeps every document on its side. The
sides are disjoint by construction: one uniform number per document, cut by the fractions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shardcache.config import check_int
from shardcache.errors import ConfigError
from shardcache.store.cache import Cache, mix64

#: The split names, in the order their intervals of ``[0, 1)`` come.
SPLIT_NAMES = ("validation", "test", "train")
#: Mixed into the seed so that a split's draw is not any other hash of the same keys.
_SPLIT_KEY = 0x53504C54


@dataclass(frozen=True)
class Split:
    """The held-out fractions of a cache's documents; the rest is ``"train"``.

    Args:
        validation: the share of documents held out for validation, in ``[0, 1)``.
        test: the share held out for test, in ``[0, 1)``.
        seed: which documents a share draws (the same seed: the same documents).

    Raises:
        ConfigError: a fraction out of range, or fractions that sum to 1 or more.
    """

    validation: float = 0.0
    test: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("validation", "test"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"Split.{name}: got {value!r}, expected a fraction in [0, 1)")
            if not (math.isfinite(value) and 0 <= value < 1):
                raise ConfigError(f"Split.{name}: got {value!r}, expected a fraction in [0, 1)")
        if self.validation + self.test >= 1:
            raise ConfigError(
                f"Split: validation={self.validation} + test={self.test} leaves no training "
                "documents; the held-out fractions must sum to less than 1"
            )
        check_int("Split.seed", self.seed, 0)

    def to_json(self) -> dict[str, Any]:
        """The split as a JSON-able dict.

        Returns:
            The fields by name.
        """
        return asdict(self)

    def labels(self, keys: np.ndarray) -> np.ndarray:
        """The side of each document key: an index into ``SPLIT_NAMES``.

        Args:
            keys: uint64 document keys (``Cache.document_keys``).

        Returns:
            uint8, one per key.
        """
        salt = mix64(np.array([self.seed, _SPLIT_KEY], dtype=np.uint64))
        draw = mix64(np.asarray(keys, dtype=np.uint64) ^ salt[0] ^ salt[1])
        uniform = (draw >> np.uint64(11)).astype(np.float64) * 2.0**-53  # in [0, 1)
        cuts = np.array([self.validation, self.validation + self.test])
        return np.searchsorted(cuts, uniform, side="right").astype(np.uint8)


def as_split(value: Any, where: str) -> Split:
    """A ``Split``, or one made of a mapping of its fields (a recipe's table); else ConfigError."""
    if isinstance(value, Split):
        return value
    if isinstance(value, dict):
        try:
            return Split(**value)
        except TypeError:
            unknown = sorted(set(value) - set(Split.__dataclass_fields__))
            raise ConfigError(
                f"{where}: unknown field(s) {unknown}; a split has validation, test and seed, "
                "e.g. {validation = 0.01, test = 0.001}"
            ) from None
    raise ConfigError(
        f"{where}: got {value!r}, expected a shardcache.Split (or a mapping of validation, test "
        "and seed)"
    )


def check_split_name(name: str) -> int:
    """The index of a split name in ``SPLIT_NAMES``; ConfigError listing them otherwise."""
    if name not in SPLIT_NAMES:
        raise ConfigError(
            f"split: got {name!r}, expected one of {', '.join(repr(n) for n in SPLIT_NAMES)}"
        )
    return SPLIT_NAMES.index(name)


def split_ids(cache: Cache, split: Split, name: str, keys: np.ndarray | None = None) -> np.ndarray:
    """The sample ids (ascending, int64) of the documents of ``cache`` on side ``name``.

    ``keys``: the cache's ``document_keys()`` when the caller has them (else they are read).
    """
    side = check_split_name(name)
    keys = cache.document_keys() if keys is None else keys
    return np.flatnonzero(split.labels(keys) == side).astype(np.int64)


def split_summary(cache: Cache, split: Split, keys: np.ndarray | None = None) -> dict[str, Any]:
    """Documents, sequences and tokens on each side of ``split`` (``shardcache info``, ``mix``)."""
    keys = cache.document_keys() if keys is None else keys
    labels = split.labels(keys)
    lengths = np.asarray(cache.lengths, dtype=np.int64)
    out: dict[str, Any] = {"split": split.to_json()}
    for side, name in enumerate(SPLIT_NAMES):
        chosen = labels == side
        out[name] = {
            "documents": len(np.unique(keys[chosen])),
            "sequences": int(chosen.sum()),
            "tokens": int(lengths[chosen].sum()),
        }
    return out


def format_split_summary(summary: dict[str, Any], indent: str = "") -> list[str]:
    """A ``split_summary`` as text lines, a side each."""
    return [
        f"{indent}split {name:<11}{summary[name]['documents']:,} documents, "
        f"{summary[name]['sequences']:,} sequences, {summary[name]['tokens']:,} tokens"
        for name in SPLIT_NAMES
    ]
