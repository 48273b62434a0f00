"""A mixture's token targets: each source's share of an epoch, and the epoch size (pure).

``solve_mixture`` turns weights and caps (``max_repetitions``) into a
[`MixtureTable`][shardcache.MixtureTable]: a source's target is ``round(share * epoch)``,
never above its cap, never 0; ``tokens_per_epoch=None`` picks the largest epoch every cap
allows. ``once_table`` is an evaluation pass's: every token once, weights unused. Which
documents give those targets is ``mixture``'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from shardcache.errors import ConfigError

#: The most tokens an epoch can hold: plans count tokens and positions in int64.
MAX_TOKENS_PER_EPOCH = 2**63 - 1


class WeightedSource(Protocol):
    """What a table reads of a source (``mixture.Source`` satisfies it)."""

    @property
    def path(self) -> str:
        """The cache folder or URL."""
        ...

    @property
    def weight(self) -> float:
        """The share of an epoch's tokens, before normalisation."""
        ...

    @property
    def max_repetitions(self) -> float:
        """How often its tokens may be used in one epoch."""
        ...

    @property
    def label(self) -> str:
        """The name used in tables and errors."""
        ...


@dataclass(frozen=True)
class SourceShare:
    """One source's row of a [`MixtureTable`][shardcache.MixtureTable].

    Attributes:
        name: the source's label.
        path: its cache.
        documents: the sequences the cache holds.
        tokens: the tokens the cache holds.
        weight: the weight given.
        share: the weight normalised over the sources.
        max_repetitions: the most times an epoch may use each of its tokens.
        tokens_per_epoch: the tokens it gives an epoch.
        repetitions: ``tokens_per_epoch / tokens`` (below 1: a subsample; above 1: upsampled).
    """

    name: str
    path: str
    documents: int
    tokens: int
    weight: float
    share: float
    max_repetitions: float
    tokens_per_epoch: int
    repetitions: float

    def to_json(self) -> dict[str, Any]:
        """The row as a JSON-able dict.

        Returns:
            The fields by name.
        """
        return dict(self.__dict__)


@dataclass(frozen=True)
class MixtureTable:
    """Per-source targets of a mixture and the epoch size they add up to.

    Attributes:
        sources: a row per source, in the mixture's order.
        tokens_per_epoch: the tokens of an epoch.
    """

    sources: tuple[SourceShare, ...]
    tokens_per_epoch: int

    def to_json(self) -> dict[str, Any]:
        """The table as a JSON-able dict (what ``shardcache mix --json`` prints).

        Returns:
            ``tokens_per_epoch`` and the rows as ``sources``.
        """
        return {
            "tokens_per_epoch": self.tokens_per_epoch,
            "sources": [s.to_json() for s in self.sources],
        }

    def format(self) -> str:
        """The table as aligned text (what ``shardcache mix`` prints).

        Returns:
            A header, a line per source and the epoch size, without a final newline.
        """
        head = ("source", "documents", "tokens", "share", "tokens/epoch", "repetitions", "max")
        rows = [
            (
                s.name,
                f"{s.documents:,}",
                f"{s.tokens:,}",
                f"{s.share:.4f}",
                f"{s.tokens_per_epoch:,}",
                f"{s.repetitions:.4f}",
                f"{s.max_repetitions:g}",
            )
            for s in self.sources
        ]
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        lines = [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
            for r in (head, *rows)
        ]
        lines.append(f"tokens per epoch: {self.tokens_per_epoch:,}")
        return "\n".join(lines)


def normalised_shares(weights: list[float]) -> list[float]:
    """Weights normalised to sum to 1, without overflow for weights near the float maximum.

    Scaling by a power of two is exact, so the shares are those of ``w / sum(w)`` whenever
    that sum is finite; a share far below the others may underflow to 0.
    """
    scale = 2.0 ** -math.frexp(max(weights))[1]
    scaled = [float(w) * scale for w in weights]
    total = sum(scaled)
    return [w / total for w in scaled]


def solve_mixture(
    sources: tuple[WeightedSource, ...],
    documents: list[int],
    tokens: list[int],
    tokens_per_epoch: int | None = None,
    side: str | None = None,
) -> MixtureTable:
    """Per-source token targets of an epoch (``tokens_per_epoch=None``: the largest that fits).

    ``documents`` and ``tokens`` are what each source gives the mixture: its whole cache, or
    the side ``side`` of its split.
    """
    if tokens_per_epoch is not None and (
        isinstance(tokens_per_epoch, bool)
        or not isinstance(tokens_per_epoch, int)
        or not 1 <= tokens_per_epoch <= MAX_TOKENS_PER_EPOCH
    ):
        raise ConfigError(
            f"tokens_per_epoch: got {tokens_per_epoch!r}, expected an integer in [1, 2**63 - 1] "
            "(or None: the largest epoch every source's share fits in)"
        )
    shares = normalised_shares([s.weight for s in sources])
    for s, n in zip(sources, tokens):
        if n <= 0 and side is not None:
            raise ConfigError(
                f"source {s.label!r} ({s.path}): its {side!r} side holds no document, so it "
                f"cannot give its share of a weighted {side} mixture; raise its {side} fraction "
                "(Source(splits=Split(...))), read the sides once with eval=True (a source "
                "with no document is then read for nothing), or leave it out of this mixture"
            )
        if n <= 0:
            raise ConfigError(
                f"source {s.label!r} ({s.path}): the cache holds no tokens, so it cannot give "
                "its share; remove it from the mixture or rebuild it"
            )
    caps = [s.max_repetitions * n for s, n in zip(sources, tokens)]  # inf past the float range
    # The largest epoch each source's cap allows (a source whose share underflows to 0 binds
    # nothing); the mixture's is the smallest.
    fits = [cap / share if share > 0 else math.inf for cap, share in zip(caps, shares)]
    largest = min(fits)
    if tokens_per_epoch is None:
        if largest > MAX_TOKENS_PER_EPOCH:
            raise ConfigError(
                f"sources {[s.label for s in sources]}: max_repetitions "
                f"{[s.max_repetitions for s in sources]} allow an epoch of {largest:.4g} tokens, "
                "more than the 2**63 - 1 a plan counts; lower max_repetitions or set "
                "tokens_per_epoch"
            )
        epoch = math.floor(largest)
    else:
        epoch = tokens_per_epoch
        for s, n, cap, share in zip(sources, tokens, caps, shares):
            needed = share * epoch
            if needed > cap + 0.5:
                most = math.floor(largest)
                raise ConfigError(
                    f"source {s.label!r} ({s.path}): its share {share:.4f} of tokens_per_epoch="
                    f"{epoch:,} needs {round(needed):,} tokens but it holds {n:,} and "
                    f"max_repetitions={s.max_repetitions:g} allows {math.floor(cap):,}; raise "
                    f"its max_repetitions to >= {needed / n:.4g}, lower its weight, or lower "
                    f"tokens_per_epoch to <= {most:,} (or leave it unset: the largest epoch "
                    "that fits)"
                )
    rows = []
    for s, docs, n, cap, share in zip(sources, documents, tokens, caps, shares):
        target = round(share * epoch)
        if target > cap:  # (an infinite cap never binds)
            target = math.floor(cap)
        if target == 0:
            raise ConfigError(
                f"source {s.label!r} ({s.path}): weight={s.weight:g} is a share {share:.4g} of "
                f"the mixture, which gives it no token of the epoch's {epoch:,}; raise its "
                f"weight (its share must be at least {0.5 / epoch:.3g}) or remove it from the "
                "mixture"
            )
        rows.append(_share_row(s, docs, n, share, target))
    return MixtureTable(tuple(rows), int(epoch))


def _share_row(
    source: WeightedSource, documents: int, tokens: int, share: float, target: int
) -> SourceShare:
    """A source's row of a table: its ``target`` tokens an epoch out of ``tokens``."""
    return SourceShare(
        name=source.label,
        path=source.path,
        documents=int(documents),
        tokens=int(tokens),
        weight=float(source.weight),
        share=share,
        max_repetitions=float(source.max_repetitions),
        tokens_per_epoch=int(target),
        repetitions=target / tokens if tokens else 1.0,
    )


def once_table(
    sources: tuple[WeightedSource, ...], documents: list[int], tokens: list[int]
) -> MixtureTable:
    """The table of an evaluation pass: every document of every source once (weights unused)."""
    total = int(sum(tokens))
    rows = [
        _share_row(s, docs, n, n / total if total else 0.0, n)
        for s, docs, n in zip(sources, documents, tokens)
    ]
    return MixtureTable(tuple(rows), total)
