"""Built-in read-time transforms: ``FIM`` (fill-in-the-middle) and ``SpanMask``.

Each is a frozen, picklable callable ``(ids, mask, rng) -> (ids, mask)`` for
``ShardDataset(transform=...)``: it keeps the sequence's length, draws everything from the
``rng`` it is given (the dataset seeds one per sequence, so the stream resumes exactly) and
does its work with a few numpy operations per sequence, never a loop over tokens. A loss
mask, when given, moves with its tokens; inserted or replaced tokens are not trainable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import ConfigError

#: The sentinel spellings ``FIM.from_tokenizer`` looks for, in (prefix, middle, suffix) order.
FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_middle>", "<fim_suffix>"),
    ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"),
)


def _check_rate(name: str, value: float) -> None:
    """Refuse a probability outside ``[0, 1]`` (or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{name}: got {value!r}, expected a number in [0, 1]")


def _check_token_id(name: str, value: int) -> None:
    """Refuse a token id that is not a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{name}: got {value!r}, expected a token id (an int >= 0)")


def _check_fits(ids: np.ndarray, names_ids: dict[str, int]) -> None:
    """Refuse sentinel ids that the cache's id dtype cannot hold (they would wrap silently)."""
    if ids.dtype.kind not in "iu":
        return
    top = np.iinfo(ids.dtype).max
    over = {k: v for k, v in names_ids.items() if v > top}
    if over:
        raise ConfigError(
            f"transform: token ids {over} do not fit the cache's ids dtype {ids.dtype} "
            f"(max {top}); use the ids of the tokenizer the cache was built with"
        )


@dataclass(frozen=True)
class FIM:
    """Fill-in-the-middle as code models train it, in its length-preserving form.

    With probability ``rate`` a sequence of at least 4 tokens is cut at two uniform points
    into prefix, middle and suffix and rewritten as ``<pre> prefix <suf> suffix <mid> middle``
    (PSM), or, with probability ``spm_rate`` among those, as ``<pre> <suf> suffix <mid> prefix
    middle`` (SPM). The last 3 tokens are dropped first, so the length is kept. Loss-mask
    entries move with their tokens; the sentinels are not trainable. Shorter sequences, and
    the others, are returned unchanged.

    Args:
        rate: the share of sequences rewritten, in ``[0, 1]``.
        prefix_id: the ``<fim_prefix>`` token id.
        middle_id: the ``<fim_middle>`` token id.
        suffix_id: the ``<fim_suffix>`` token id.
        spm_rate: the share of rewritten sequences in SPM order, in ``[0, 1]``.

    Raises:
        ConfigError: a rate out of range, a sentinel id that is not an int >= 0, or two
            sentinels with the same id (at construction); sentinel ids that the cache's id
            dtype cannot hold (on the first sequence).
    """

    rate: float
    prefix_id: int
    middle_id: int
    suffix_id: int
    spm_rate: float = 0.0

    def __post_init__(self) -> None:
        _check_rate("FIM rate", self.rate)
        _check_rate("FIM spm_rate", self.spm_rate)
        ids = self._sentinels()
        for name, value in ids.items():
            _check_token_id(f"FIM {name}", value)
        if len(set(ids.values())) != 3:
            raise ConfigError(
                f"FIM: the sentinel ids must differ, got {ids}; pass the ids of "
                "<fim_prefix>, <fim_middle> and <fim_suffix> (FIM.from_tokenizer reads them)"
            )

    def _sentinels(self) -> dict[str, int]:
        return {
            "prefix_id": self.prefix_id,
            "middle_id": self.middle_id,
            "suffix_id": self.suffix_id,
        }

    @classmethod
    def from_tokenizer(
        cls, tokenizer_json_path: str | os.PathLike[str], rate: float, spm_rate: float = 0.0
    ) -> FIM:
        """A ``FIM`` with the sentinel ids of a tokenizer's added tokens.

        Args:
            tokenizer_json_path: a ``tokenizer.json`` file, or a folder holding one.
            rate: the share of sequences rewritten, in ``[0, 1]``.
            spm_rate: the share of rewritten sequences in SPM order, in ``[0, 1]``.

        Returns:
            The transform, with the ids of ``<fim_prefix>``, ``<fim_middle>`` and
            ``<fim_suffix>`` (or StarCoder's ``<|fim_prefix|>`` spellings).

        Raises:
            ConfigError: the file cannot be read as a tokenizer.json, or it has no complete
                set of FIM sentinels among its added tokens (the message names those looked
                for), or a rate out of range.
        """
        path = os.fspath(tokenizer_json_path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        try:
            with open(path, encoding="utf-8") as f:
                data: Any = json.load(f)
            added = {str(t["content"]): int(t["id"]) for t in data.get("added_tokens") or []}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            raise ConfigError(
                f"FIM.from_tokenizer: cannot read the added tokens of {path!r} ({err}); "
                "pass a tokenizer.json (or its folder) as transformers saves it"
            ) from err
        for names in FIM_SPELLINGS:
            if all(n in added for n in names):
                prefix, middle, suffix = (added[n] for n in names)
                return cls(rate, prefix, middle, suffix, spm_rate)
        looked = " or ".join(", ".join(names) for names in FIM_SPELLINGS)
        raise ConfigError(
            f"FIM.from_tokenizer: {path!r} has no FIM sentinels among its added tokens "
            f"(looked for {looked}); use a tokenizer trained with them, or pass the ids to FIM()"
        )

    def __call__(
        self, ids: np.ndarray, mask: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Rewrite ``ids`` (and ``mask``) in FIM form with probability ``rate``."""
        n = len(ids)
        # one draw per question, always made: the decision does not shift the cut points
        apply, spm = rng.random(2)
        if n < 4 or apply >= self.rate:
            return ids, mask
        _check_fits(ids, self._sentinels())
        body = n - 3
        a, b = np.sort(rng.integers(0, body + 1, size=2))
        pos = np.arange(body, dtype=np.int64)
        pre, mid, suf = pos[:a], pos[a:b], pos[b:]
        # -1, -2, -3 stand for the sentinels in the gather below
        if spm < self.spm_rate:
            order = np.concatenate([[-1, -3], suf, [-2], pre, mid])
        else:
            order = np.concatenate([[-1], pre, [-3], suf, [-2], mid])
        sentinel = order < 0
        out = ids[np.where(sentinel, 0, order)]
        out[order == -1] = self.prefix_id
        out[order == -2] = self.middle_id
        out[order == -3] = self.suffix_id
        if mask is None:
            return out, None
        new_mask = np.asarray(mask, dtype=bool)[np.where(sentinel, 0, order)]
        new_mask[sentinel] = False
        return out, new_mask


@dataclass(frozen=True)
class SpanMask:
    """Random span masking: replace ``rate`` of a sequence's tokens, in spans, by ``mask_id``.

    ``round(rate * len)`` tokens are masked, in about ``len * rate / mean_span`` spans whose
    lengths split that count at uniform points (spans that touch merge). The length is kept;
    masked tokens are not trainable in a loss mask, the others keep theirs.

    Args:
        rate: the share of tokens masked, in ``[0, 1]``.
        mask_id: the mask token's id.
        mean_span: the mean span length, in tokens (>= 1).

    Raises:
        ConfigError: a rate out of range, a mask id that is not an int >= 0 or a
            ``mean_span`` below 1 (at construction); a mask id that the cache's id dtype
            cannot hold (on the first sequence).
    """

    rate: float
    mask_id: int
    mean_span: float = 3

    def __post_init__(self) -> None:
        _check_rate("SpanMask rate", self.rate)
        _check_token_id("SpanMask mask_id", self.mask_id)
        span = self.mean_span
        if isinstance(span, bool) or not isinstance(span, (int, float)) or not span >= 1:
            raise ConfigError(f"SpanMask mean_span: got {span!r}, expected a number >= 1")

    def __call__(
        self, ids: np.ndarray, mask: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Mask random spans of ``ids`` (and make them untrainable in ``mask``)."""
        n = len(ids)
        masked = round(n * self.rate)
        if masked == 0:
            return ids, mask
        _check_fits(ids, {"mask_id": self.mask_id})
        spans = int(min(max(1, round(masked / self.mean_span)), masked))
        # span lengths: ``masked`` split at spans-1 distinct points (each span >= 1 token)
        # (one ``random`` draw each: Generator.choice and .integers cost more than the rest)
        draws = rng.random(masked - 1)
        cuts = np.sort(np.argsort(draws)[: spans - 1] + 1)
        lengths = np.diff(np.concatenate([[0], cuts, [masked]]))
        # where each span goes among the unmasked tokens, then shifted past the earlier spans
        gaps = np.sort((rng.random(spans) * (n - masked + 1)).astype(np.int64))
        starts = gaps + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        edges = np.zeros(n + 1, dtype=np.int64)
        edges[starts] += 1  # the starts are distinct, and so are the ends (spans never overlap)
        edges[starts + lengths] -= 1
        hit = np.cumsum(edges[:n]) > 0
        out = ids.copy()
        out[hit] = self.mask_id
        if mask is None:
            return out, None
        return out, np.asarray(mask, dtype=bool) & ~hit
