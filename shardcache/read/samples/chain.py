"""Read-time transforms as a protocol, and a sequence of them applied to each segment, checked.

A ``Transform`` is any callable ``(ids, mask, rng) -> (ids, mask)`` (a function, ``FIM``,
``SpanMask``, your own class): nothing in the library changes to add one. ``ShardDataset``
takes one or a sequence; ``TransformChain`` runs them in order on every gathered segment, each
with a generator of its own seeded by (seed, epoch, sample id, repetition, segment start, and
the wrap of a batch ``tail="wrap"`` reads again), and checks what each returns: its shape and
length, its loss mask, and every id (an int from 0 to the cache's largest id, so that a label is
-100 or a real id and no value wraps in the batch's ids dtype), a few numpy reductions per
segment. A transform always runs on the numpy path (the compiled batch path runs none), so this
check is the only one its ids pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from shardcache.errors import ConfigError
from shardcache.store.cache import Gathered

#: Mixed into a transform's seed so that it is no other generator of the same numbers.
TRANSFORM_KEY = 0x54524E53
#: Mixed into the seed of every transform after the first of a chain.
CHAIN_KEY = 0x4348414E
#: A batch's wrap rides in the high bits of its segments' repetitions (a mixture's are small).
WRAP_SHIFT = 32


@runtime_checkable
class Transform(Protocol):
    """A per-sequence read-time step: ``transform(ids, mask, rng) -> (ids, mask)``.

    ``ids`` are a segment's token ids (numpy ints, a copy), ``mask`` its chat loss mask or None,
    ``rng`` a ``numpy.random.Generator`` seeded by the segment's place in the stream. Optional
    attributes: ``max_growth`` (int, the tokens it may add; default 0), ``keeps_mask`` (bool,
    whether it carries a chat loss mask with its tokens; default True) and a
    ``check_tokens(max_token_id, dtype)`` method that refuses ids the cache lacks.
    """

    def __call__(
        self, ids: np.ndarray, mask: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The transformed ids and loss mask (None where the cache has no masks)."""


def growth_of(transform: Any) -> int:
    """The tokens ``transform`` may add to a sequence (its ``max_growth``, default 0), checked."""
    if not callable(transform):
        raise ConfigError(
            f"transform: got {transform!r}, expected a function (ids, mask, rng) -> (ids, mask)"
        )
    growth = getattr(transform, "max_growth", 0)
    if isinstance(growth, bool) or not isinstance(growth, (int, np.integer)) or growth < 0:
        raise ConfigError(
            f"transform: max_growth={growth!r}, expected an int >= 0 (the tokens it may add to "
            "a sequence; 0 for a transform that keeps or shortens the length)"
        )
    return int(growth)


class TransformChain:
    """One transform or several, applied in order to every gathered segment.

    Args:
        transforms: a ``Transform`` or a sequence of them (applied first to last).

    Raises:
        ConfigError: an empty sequence, or a step that is not callable or declares a bad
            ``max_growth``.
    """

    def __init__(self, transforms: Transform | Sequence[Transform]) -> None:
        steps = tuple(transforms) if isinstance(transforms, (list, tuple)) else (transforms,)
        if not steps:
            raise ConfigError("transform: got an empty sequence; pass None for no transform")
        self.steps: tuple[Transform, ...] = steps
        #: the tokens the chain may add to a sequence: every step's together
        self.max_growth = sum(growth_of(step) for step in steps)
        #: whether every step carries a chat loss mask with its tokens
        self.keeps_mask = all(getattr(step, "keeps_mask", True) for step in steps)

    def __repr__(self) -> str:
        return repr(self.steps[0]) if len(self.steps) == 1 else f"TransformChain{self.steps!r}"

    def check_tokens(self, max_token_id: int, dtype: np.dtype) -> None:
        """Let every step refuse ids the cache's tokenizer lacks (its ``check_tokens``)."""
        for step in self.steps:
            check = getattr(step, "check_tokens", None)
            if callable(check):
                check(max_token_id, dtype)

    def apply(
        self,
        got: Gathered,
        sample_ids: np.ndarray,
        starts: np.ndarray,
        repeats: np.ndarray,
        seed: int,
        epoch: int,
        growth: int,
        max_token_id: int,
    ) -> Gathered:
        """The chain run on each gathered segment with its own seeded generators, checked.

        ``repeats`` carry each segment's repetition, a wrap in their high bits; ``growth`` is
        what the plan reserved per segment; ``max_token_id`` the largest id a step may return.

        Raises:
            ConfigError: a step returned something else than ``(ids, mask)`` of the allowed
                length, or an id that is not an int from 0 to ``max_token_id``.
        """
        tokens, mask = got.tokens, got.mask
        offsets = got.offsets.tolist()
        uses, wraps = repeats & ((1 << WRAP_SHIFT) - 1), repeats >> WRAP_SHIFT
        keys = np.stack([sample_ids, uses, starts, wraps]).T.tolist()
        out_ids: list[np.ndarray] = []
        out_masks: list[np.ndarray] = []
        for k, (sample, use, start, wrap) in enumerate(keys):
            lo, hi = offsets[k], offsets[k + 1]
            n = hi - lo
            key = [seed, epoch, sample, use, start, TRANSFORM_KEY]
            if wrap:  # read again by tail="wrap": its own generator (a first read's is as before)
                key.append(wrap)
            ids, seg_mask = tokens[lo:hi], None if mask is None else mask[lo:hi]
            for step, transform in enumerate(self.steps):
                rng = np.random.default_rng(key if step == 0 else [*key, CHAIN_KEY, step])
                given = None if seg_mask is None else seg_mask.copy()  # (kept as it was)
                out = transform(ids.copy(), given, rng)
                ids, seg_mask = _checked(out, ids, seg_mask, n, growth, sample, start)
                _check_ids(ids, max_token_id, tokens.dtype, transform, sample, start)
            out_ids.append(ids)
            if seg_mask is not None:
                out_masks.append(seg_mask)
        new_offsets = np.zeros(len(out_ids) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids in out_ids], out=new_offsets[1:])
        new_tokens = (
            np.concatenate(out_ids).astype(tokens.dtype, copy=False)
            if out_ids
            else tokens[:0].copy()
        )
        new_mask_all = None
        if mask is not None:
            new_mask_all = np.concatenate(out_masks) if out_masks else mask[:0].copy()
        return Gathered(new_tokens, new_offsets, new_mask_all)


def _checked(
    out: Any,
    given: np.ndarray,
    given_mask: np.ndarray | None,
    n: int,
    growth: int,
    sample: int,
    start: int,
) -> tuple[np.ndarray, np.ndarray | None]:
    """A transform's ``(ids, mask)`` checked against the segment of ``n`` stored tokens."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise ConfigError(f"transform: returned {type(out).__name__}, expected a tuple (ids, mask)")
    ids, new_mask = np.asarray(out[0]), out[1]
    if ids.ndim != 1 or not min(n, 1) <= len(ids) <= n + growth:
        raise ConfigError(
            f"transform: returned ids of shape {ids.shape} for sample {sample} (piece "
            f"at token {start}) of {n} tokens, but it declared max_growth={growth}: the "
            f"plan reserved room for 1 to {n + growth} tokens. Return at most "
            "max_growth more tokens than given (truncate inside the transform), or "
            "declare a larger max_growth attribute on the transform"
        )
    if given_mask is None:
        return ids, None
    if new_mask is None:
        if len(ids) != len(given):
            raise ConfigError(
                f"transform: returned {len(ids)} ids but no loss mask for sample {sample} "
                f"of {n} tokens of a chat cache; the mask cannot follow tokens it was "
                "not given: return the mask moved with the tokens (inserted tokens "
                "False), or keep the length"
            )
        new_mask = given_mask
    new_mask = np.asarray(new_mask, dtype=bool)
    if new_mask.shape != ids.shape:
        raise ConfigError(
            f"transform: returned a loss mask of shape {new_mask.shape} with ids of "
            f"shape {ids.shape} for sample {sample}; return one mask entry per token"
        )
    return ids, new_mask


def _check_ids(
    ids: np.ndarray, top: int, dtype: np.dtype, transform: Any, sample: int, start: int
) -> None:
    """Refuse an id that is not a whole number from 0 to ``top`` (the cache's largest id).

    One reduction per segment on the common path: a signed array viewed as unsigned puts the
    negative ids above every real one. Only a failing segment is searched for its first bad id.
    """
    kind = ids.dtype.kind
    if kind in "iu":
        if not ids.size:
            return
        as_unsigned = ids if kind == "u" else ids.view(f"u{ids.dtype.itemsize}")
        if int(as_unsigned.max()) <= top:
            return
        bad = (ids < 0) | (ids > top)
    elif kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(ids) & (ids >= 0) & (ids <= top) & (ids == np.trunc(ids)))
        if not bad.any():
            return
    else:
        raise ConfigError(
            f"transform {transform!r}: sample {sample} (piece at token {start}) returned ids "
            f"of dtype {ids.dtype}; return an array of integer token ids (the ids it was given "
            "are numpy ints)"
        )
    at = int(np.flatnonzero(bad)[0])
    value = ids[at].item()
    if kind == "f" and not np.isfinite(value):
        why = "not a finite number"
    elif kind == "f" and value != int(value):
        why = "not a whole number"
    elif value < 0:
        why = "below 0"
    else:
        why = f"past the largest id {top} of the tokenizer the cache was built with"
        info = np.iinfo(dtype)
        if value > info.max:
            wrapped = np.array([value], dtype=np.uint64).astype(dtype)[0]
            why += f"; in the batch's {dtype} ids it would wrap to {wrapped}"
    raise ConfigError(
        f"transform {transform!r}: sample {sample} (piece at token {start}) returned id "
        f"{value} at position {at}: {why}. The cache's ids are 0 to {top}, so that a label is "
        "-100 or a real id; return ids of the tokenizer the cache was built with"
    )
