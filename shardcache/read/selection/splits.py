"""Held-out splits: which documents of a cache are train, validation or test.

A split is a filter on documents before the plan. A document's side is a function of its key
and the split's seed and fractions only. The key is the document's content key (a hash of its
whole text, stored at build time: ``Cache.content_keys``), so renaming, re-cutting or
duplicating input files never moves or doubles a document across sides, and equal documents
are on one side. A cache built before content keys, or ``Split(key="path")``, keys documents
by input file and record index instead. Either way every piece of a document cut by
``truncation="split"`` and both sides of a pair are on one side, and a rebuild of the same
inputs with other shard sizes, workers or bucket edges keeps every document on its side. The
sides are disjoint by construction: one uniform number per key, cut by the fractions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shardcache.config import check_int
from shardcache.errors import ConfigError
from shardcache.store.cache import Cache, mix64

logger = logging.getLogger("shardcache")

#: The split names, in the order their intervals of ``[0, 1)`` come.
SPLIT_NAMES = ("validation", "test", "train")
#: What a split keys documents by: their content (the default) or their input file and record.
SPLIT_KEYS = ("content", "path")
#: The caches whose fallback to path keys this process has noted (by path and length index).
_NOTED: set[tuple[str, str]] = set()
#: Mixed into the seed so that a split's draw is not any other hash of the same keys.
_SPLIT_KEY = 0x53504C54


@dataclass(frozen=True)
class Split:
    """The held-out fractions of a cache's documents; the rest is ``"train"``.

    Args:
        validation: the share of documents held out for validation, in ``[0, 1)``.
        test: the share held out for test, in ``[0, 1)``.
        seed: which documents a share draws (the same seed: the same documents).
        key: what identifies a document. ``"content"``: a hash of its whole text, stored at
            build time, so renamed, re-cut or duplicated input files never move or double a
            document across sides; a cache built before content keys is read with its path
            keys instead (``shardcache info --split`` says so; rebuild it for content keys).
            ``"path"``: its input file (relative path) and record index, the keys of
            shardcache before content keys.

    Raises:
        ConfigError: a fraction out of range, fractions that sum to 1 or more, or another key.
    """

    validation: float = 0.0
    test: float = 0.0
    seed: int = 0
    key: str = "content"

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
        if self.key not in SPLIT_KEYS:
            raise ConfigError(
                f"Split.key: got {self.key!r}, expected 'content' (a hash of each document's "
                "text, the default) or 'path' (its input file and record index)"
            )

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
                f"{where}: unknown field(s) {unknown}; a split has validation, test, seed and "
                "key, e.g. {validation = 0.01, test = 0.001}"
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


def split_key(cache: Cache, split: Split) -> str:
    """The key ``split`` draws the documents of ``cache`` by: ``"content"`` or ``"path"``.

    ``split.key``, but ``"path"`` for a cache built before content keys; that fallback is
    noted once per cache and process on the ``"shardcache"`` logger (INFO): it is the
    behaviour those caches always had, so it is no warning, and ``shardcache info --split``
    shows it.
    """
    if split.key == "path" or cache.content_keys is not None:
        return split.key
    noted = (cache.path, str(cache.manifest["index"]["lengths"]["sha256"]))
    if noted not in _NOTED:
        _NOTED.add(noted)
        logger.info(
            "%s: built before content keys, so a split draws its documents by path keys "
            "(input file and record index): a renamed, re-cut or duplicated input file moves "
            "or doubles documents across sides. Rebuild the cache for content keys, or pass "
            "Split(key='path') to keep these sides on purpose",
            cache.path,
        )
    return "path"


def split_keys(cache: Cache, split: Split) -> np.ndarray:
    """The document key of every sample id of ``cache`` that ``split`` draws by (``split_key``)."""
    return cache.document_keys(split_key(cache, split))


def split_state(cache: Cache, split: Split) -> dict[str, Any]:
    """What a reader state records of ``split`` on ``cache``: its fields.

    ``key`` only where the cache has content keys (elsewhere both keys are its path keys), so a
    state taken before content keys loads unchanged on the cache it was taken on.
    """
    state = split.to_json()
    if cache.content_keys is None:
        del state["key"]
    return state


def split_ids(cache: Cache, split: Split, name: str, keys: np.ndarray | None = None) -> np.ndarray:
    """The sample ids (ascending, int64) of the documents of ``cache`` on side ``name``.

    ``keys``: the cache's ``split_keys(cache, split)`` when the caller has them (else read).
    """
    side = check_split_name(name)
    keys = split_keys(cache, split) if keys is None else keys
    return np.flatnonzero(split.labels(keys) == side).astype(np.int64)


def check_sides(rows: Sequence[np.ndarray], splits: Sequence[Split], name: str, where: str) -> None:
    """Refuse a read of side ``name`` that holds no document in any cache (ConfigError).

    ``rows``: each cache's sample ids on the side, by its ``splits``. An empty side would plan
    an epoch of no batch, which every rank then reads for nothing (and an evaluation pass
    measures nothing): refused when the dataset is made, naming the side and its fraction.
    """
    if any(len(r) for r in rows):
        return
    unique = list(dict.fromkeys(splits))
    shown = " / ".join(map(str, unique))
    fractions = {getattr(s, name) for s in unique} if name != "train" else set()
    if name == "train":
        why, fix = "the held-out fractions leave it no document", "lower the held-out fractions"
    elif fractions == {0}:
        why, fix = f"{name}={fractions.pop()}", f"give Split({name}=...) a fraction > 0"
    else:
        why = f"{name}={' / '.join(map(str, sorted(fractions)))} draws none of the documents"
        fix = f"raise Split({name}=...)"
    raise ConfigError(
        f"{where}: the {name!r} side of {shown} holds no document ({why}), so its epoch has no "
        f"batch; {fix} or read another side"
    )


def split_summary(cache: Cache, split: Split, keys: np.ndarray | None = None) -> dict[str, Any]:
    """Documents, sequences and tokens on each side of ``split`` (``shardcache info``, ``mix``).

    Also the key the split draws by (``split_key``) and ``documents_on_several_sides``: the
    documents (distinct contents) with sequences on more than one side, 0 by construction
    with content keys; None in a cache built before content keys (it cannot tell).
    ``keys``: the cache's ``split_keys(cache, split)`` when the caller has them (else read).
    """
    key = split_key(cache, split)
    keys = cache.document_keys(key) if keys is None else keys
    labels = split.labels(keys)
    lengths = np.asarray(cache.lengths, dtype=np.int64)
    out: dict[str, Any] = {"split": split.to_json(), "key": key}
    for side, name in enumerate(SPLIT_NAMES):
        chosen = labels == side
        out[name] = {
            "documents": len(np.unique(keys[chosen])),
            "sequences": int(chosen.sum()),
            "tokens": int(lengths[chosen].sum()),
        }
    content = cache.content_keys
    out["documents_on_several_sides"] = (
        None if content is None else documents_on_several_sides(content, labels)
    )
    return out


def documents_on_several_sides(content: np.ndarray, labels: np.ndarray) -> int:
    """How many distinct ``content`` keys have sequences with more than one label."""
    if not len(content):
        return 0
    order = np.lexsort((labels, content))
    keys, sides = content[order], labels[order]
    new_doc = np.concatenate([[True], keys[1:] != keys[:-1]])
    new_side = new_doc | np.concatenate([[False], sides[1:] != sides[:-1]])
    sides_per_doc = np.add.reduceat(new_side.astype(np.int64), np.flatnonzero(new_doc))
    return int((sides_per_doc > 1).sum())


def format_split_summary(summary: dict[str, Any], indent: str = "") -> list[str]:
    """A ``split_summary`` as text lines, a side each, then the key the split draws by."""
    lines = [
        f"{indent}split {name:<11}{summary[name]['documents']:,} documents, "
        f"{summary[name]['sequences']:,} sequences, {summary[name]['tokens']:,} tokens"
        for name in SPLIT_NAMES
    ]
    several = summary["documents_on_several_sides"]
    if several is None:
        lines.append(
            f"{indent}split keys       path keys (input file and record index): the cache was "
            "built before content keys, so a renamed, re-cut or duplicated input file moves or "
            "doubles documents across sides; rebuild it for content keys"
        )
    else:
        lines.append(
            f"{indent}split keys       {summary['key']}; documents on more than one side: "
            f"{several:,}"
        )
    return lines
