"""Built-in read-time transforms: ``FIM`` (fill-in-the-middle) and ``SpanMask``.

Each is a frozen, picklable callable ``(ids, mask, rng) -> (ids, mask)`` for
``ShardDataset(transform=...)``: it declares how many tokens it may add (``max_growth``; the
plan reserves them), draws everything from the ``rng`` it is given (the dataset seeds one per
sequence, so the stream resumes exactly) and does its work with a few numpy operations per
sequence, never a loop over tokens. A loss mask, when given, moves with its tokens; inserted
or replaced tokens are not trainable.
"""

from __future__ import annotations

import json
import os
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

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


def _check_vocabulary(
    what: str, names_ids: dict[str, int], max_token_id: int, dtype: np.dtype
) -> None:
    """Refuse ids past the tokenizer's largest id (another tokenizer's) or the cache's dtype."""
    over = {k: v for k, v in names_ids.items() if v > max_token_id}
    if over:
        raise ConfigError(
            f"{what}: token ids {over} are past the largest id {max_token_id} of the tokenizer "
            "the cache was built with; take them from that tokenizer (FIM.from_tokenizer "
            "reads them from its added tokens)"
        )
    _check_fits(np.zeros(0, dtype=dtype), names_ids)


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
    """Fill-in-the-middle as code models train it: whole sequences, or fragments of them.

    With probability ``rate`` a sequence (with ``split_token``: each fragment between two
    such tokens, independently) is cut at two uniform points into prefix, middle and suffix
    and rewritten as ``<pre> prefix <suf> suffix <mid> middle`` (PSM), or, with probability
    ``spm_rate`` among those, as ``<pre> <suf> suffix <mid> prefix middle`` (SPM). The split
    tokens stay where they were, between the fragments.

    By default the three sentinels are added: a rewritten fragment grows by 3 tokens and the
    transform declares ``max_growth = 3 * max_fragments``, which ``ShardDataset`` reserves in
    its plan. Beyond ``max_fragments`` rewritten fragments of one sequence, the others are
    rewritten in the length-keeping form. ``keep_length=True`` is that form for every
    fragment: its last 3 tokens give way to the sentinels (``max_growth = 0``; with
    ``packing="concat"`` it rewrites each piece a row holds, the growing form whole
    documents). A fragment needs 1 token to be rewritten (4 when it keeps its length);
    shorter ones, and the others, are returned unchanged. Loss-mask entries move
    with their tokens; the sentinels are not trainable.

    Args:
        rate: the share of sequences (fragments) rewritten, in ``[0, 1]``.
        prefix_id: the ``<fim_prefix>`` token id.
        middle_id: the ``<fim_middle>`` token id.
        suffix_id: the ``<fim_suffix>`` token id.
        spm_rate: the share of rewritten fragments in SPM order, in ``[0, 1]``.
        keep_length: keep every sequence's length (drop 3 tokens per rewritten fragment).
        split_token: a token id that separates fragments (an EOS or file separator), or None.
        max_fragments: with ``split_token`` and ``keep_length=False``, how many fragments of
            a sequence may grow (each by 3 tokens; the plan reserves ``3 * max_fragments``).

    Raises:
        ConfigError: a rate out of range, a sentinel or split id that is not an int >= 0,
            two of them with the same id, or ``max_fragments`` below 1 or without
            ``split_token`` (at construction); ids that the cache's id dtype cannot hold (on
            the first sequence rewritten).
    """

    rate: float
    prefix_id: int
    middle_id: int
    suffix_id: int
    spm_rate: float = 0.0
    _: KW_ONLY
    keep_length: bool = False
    split_token: int | None = None
    max_fragments: int = 1

    #: Loss masks move with their tokens (``ShardDataset`` accepts it on chat caches).
    keeps_mask: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_rate("FIM rate", self.rate)
        _check_rate("FIM spm_rate", self.spm_rate)
        if not isinstance(self.keep_length, bool):
            raise ConfigError(f"FIM keep_length: got {self.keep_length!r}, expected True or False")
        ids = self._sentinels()
        for name, value in ids.items():
            _check_token_id(f"FIM {name}", value)
        if self.split_token is not None:
            _check_token_id("FIM split_token", self.split_token)
            ids["split_token"] = self.split_token
        if len(set(ids.values())) != len(ids):
            raise ConfigError(
                f"FIM: the sentinel ids must differ, got {ids}; pass the ids of "
                "<fim_prefix>, <fim_middle> and <fim_suffix> (FIM.from_tokenizer reads them)"
                + (" and a split token that is none of them" if len(ids) == 4 else "")
            )
        m = self.max_fragments
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ConfigError(f"FIM max_fragments: got {m!r}, expected an int >= 1")
        if m != 1 and (self.split_token is None or self.keep_length):
            raise ConfigError(
                f"FIM max_fragments: got {m} with split_token={self.split_token!r}, "
                f"keep_length={self.keep_length}; it counts the fragments that grow, so it "
                "needs a split_token and keep_length=False (or leave it at 1)"
            )

    def check_tokens(self, max_token_id: int, dtype: np.dtype) -> None:
        """Refuse ids the cache's tokenizer does not have (``ShardDataset`` calls it at start).

        Args:
            max_token_id: the largest id of the tokenizer the cache was built with.
            dtype: the cache's token dtype.

        Raises:
            ConfigError: a sentinel or split id past ``max_token_id`` or ``dtype``.
        """
        ids = self._sentinels()
        if self.split_token is not None:
            ids["split_token"] = self.split_token
        _check_vocabulary("FIM", ids, max_token_id, dtype)

    @property
    def max_growth(self) -> int:
        """The most tokens a sequence gains: 3 per fragment that may grow, 0 with keep_length."""
        return 0 if self.keep_length else 3 * int(self.max_fragments)

    def _sentinels(self) -> dict[str, int]:
        return {
            "prefix_id": self.prefix_id,
            "middle_id": self.middle_id,
            "suffix_id": self.suffix_id,
        }

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer_json_path: str | os.PathLike[str],
        rate: float,
        spm_rate: float = 0.0,
        *,
        keep_length: bool = False,
        split_token: int | str | None = None,
        max_fragments: int = 1,
    ) -> FIM:
        """A ``FIM`` with the sentinel ids of a tokenizer's added tokens.

        Args:
            tokenizer_json_path: a ``tokenizer.json`` file, or a folder holding one.
            rate: the share of sequences (fragments) rewritten, in ``[0, 1]``.
            spm_rate: the share of rewritten fragments in SPM order, in ``[0, 1]``.
            keep_length: as ``FIM(keep_length=...)``.
            split_token: the separator's id, or its spelling among the added tokens (e.g.
                ``"<file_sep>"`` or ``"<|endoftext|>"``), or None.
            max_fragments: as ``FIM(max_fragments=...)``.

        Returns:
            The transform, with the ids of ``<fim_prefix>``, ``<fim_middle>`` and
            ``<fim_suffix>`` (or StarCoder's ``<|fim_prefix|>`` spellings).

        Raises:
            ConfigError: the file cannot be read as a tokenizer.json, or it has no complete
                set of FIM sentinels among its added tokens (the message names those looked
                for), a ``split_token`` spelling it does not have, or an option out of range.
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
        if isinstance(split_token, str):
            if split_token not in added:
                raise ConfigError(
                    f"FIM.from_tokenizer: split_token {split_token!r} is not among the added "
                    f"tokens of {path!r} (it has {sorted(added)[:12]}); pass its id, or a "
                    "spelling the tokenizer has"
                )
            split_token = added[split_token]
        for names in FIM_SPELLINGS:
            if all(n in added for n in names):
                prefix, middle, suffix = (added[n] for n in names)
                return cls(
                    rate, prefix, middle, suffix, spm_rate, keep_length=keep_length,
                    split_token=split_token, max_fragments=max_fragments,
                )  # fmt: skip
        looked = " or ".join(", ".join(names) for names in FIM_SPELLINGS)
        raise ConfigError(
            f"FIM.from_tokenizer: {path!r} has no FIM sentinels among its added tokens "
            f"(looked for {looked}); use a tokenizer trained with them, or pass the ids to FIM()"
        )

    def __call__(
        self, ids: np.ndarray, mask: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Rewrite ``ids`` (and ``mask``) in FIM form, each fragment with probability ``rate``."""
        n = len(ids)
        if self.split_token is None:
            begin = np.zeros(1, dtype=np.int64)
            end = np.array([n], dtype=np.int64)
        else:  # fragments between split tokens; each split token stays after its fragment
            seps = np.flatnonzero(ids == self.split_token)
            begin = np.concatenate([[0], seps + 1])
            end = np.concatenate([seps, [n]])
        size = end - begin
        # one row of draws per fragment, always made: decisions do not shift other draws
        draws = rng.random((len(size), 4))
        applied = (draws[:, 0] < self.rate) & (size >= (4 if self.keep_length else 1))
        if not applied.any():
            return ids, mask
        if self.keep_length:
            grows = np.zeros_like(applied)
        else:  # past max_fragments, a rewritten fragment keeps its length (if it can)
            grows = applied & (np.cumsum(applied) <= self.max_fragments)
            applied &= grows | (size >= 4)
        sentinels = self._sentinels()
        if self.split_token is not None:
            sentinels["split_token"] = self.split_token
        _check_fits(ids, sentinels)
        # runs of the output: (first source position, or -1/-2/-3 for a sentinel; length);
        # the fragments left alone between two rewritten ones are one run of the source. A
        # loop over the rewritten fragments, not over tokens
        runs: list[tuple[int, int]] = []
        cursor = 0
        rows = np.flatnonzero(applied)
        picked = zip(
            begin[rows].tolist(), end[rows].tolist(), grows[rows].tolist(),
            draws[rows].tolist(),
        )  # fmt: skip
        for first, last, grow, (_, order, u, v) in picked:
            body = last - first - (0 if grow else 3)  # the tokens the fragment keeps
            a, b = sorted((int(u * (body + 1)), int(v * (body + 1))))
            runs.append((cursor, first - cursor))
            pre, mid, suf = (first, a), (first + a, b - a), (first + b, body - b)
            if order < self.spm_rate:  # <pre> <suf> suffix <mid> prefix middle
                runs += [(-1, 1), (-3, 1), suf, (-2, 1), pre, mid]
            else:  # <pre> prefix <suf> suffix <mid> middle
                runs += [(-1, 1), pre, (-3, 1), suf, (-2, 1), mid]
            cursor = last  # (a fragment that keeps its length drops its last 3 tokens)
        runs.append((cursor, n - cursor))
        src, run = np.array(runs, dtype=np.int64).T
        starts = np.cumsum(run) - run
        order = np.repeat(src - starts, run) + np.arange(int(run.sum()), dtype=np.int64)
        sentinel = order < 0
        at = np.where(sentinel, 0, order)
        out = ids[at]
        out[order == -1] = self.prefix_id
        out[order == -2] = self.middle_id
        out[order == -3] = self.suffix_id
        if mask is None:
            return out, None
        new_mask = np.asarray(mask, dtype=bool)[at]
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

    def check_tokens(self, max_token_id: int, dtype: np.dtype) -> None:
        """Refuse a mask id the cache's tokenizer does not have (``ShardDataset`` calls it).

        Args:
            max_token_id: the largest id of the tokenizer the cache was built with.
            dtype: the cache's token dtype.

        Raises:
            ConfigError: ``mask_id`` past ``max_token_id`` or ``dtype``.
        """
        _check_vocabulary("SpanMask", {"mask_id": self.mask_id}, max_token_id, dtype)

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
