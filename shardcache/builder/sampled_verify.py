"""In-build verification of a fast backend: a seeded sample of documents re-encoded with HF.

``sampled`` picks records independently of batching, process count and resume;
``SampleVerifier`` compares their fast ids with HF's in background threads, a few groups
behind the encoder. ``first_difference`` says where two encodings first differ.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.builder.ahead import Ahead
from shardcache.builder.hf_backend import HFBackend


def first_difference(
    texts: list[str],
    reference: tuple[np.ndarray, np.ndarray],
    candidate: tuple[np.ndarray, np.ndarray],
) -> str | None:
    """Where HF's ``reference`` and the ``candidate`` encoding first differ (None: equal)."""
    ref_tokens, ref_lengths = reference
    tokens, lengths = candidate
    if np.array_equal(ref_lengths, lengths) and np.array_equal(ref_tokens, tokens):
        return None
    ref_ends, ends = np.cumsum(ref_lengths), np.cumsum(lengths)
    for i, text in enumerate(texts):
        a = ref_tokens[ref_ends[i] - ref_lengths[i] : ref_ends[i]]
        b = tokens[ends[i] - lengths[i] : ends[i]] if i < len(lengths) else np.zeros(0, np.uint32)
        if np.array_equal(a, b):
            continue
        n = min(len(a), len(b))
        at = int(np.argmax(a[:n] != b[:n])) if n and (a[:n] != b[:n]).any() else n
        return (
            f"text {i} ({text[:60]!r}{'...' if len(text) > 60 else ''}): at id {at}, HF gives "
            f"{a[at : at + 4].tolist()} (of {len(a)}) and the fast backend "
            f"{b[at : at + 4].tolist()} (of {len(b)})"
        )
    return f"{len(texts)} texts: the backends return {len(ref_lengths)} and {len(lengths)} ids"


@dataclass
class VerifyCounts:
    """In-build verification of one partition (fast backend only): counts and mismatches."""

    documents: int = 0
    tokens: int = 0
    mismatches: int = 0
    detail: list[str] = field(default_factory=list)


#: However low the verification rate, the sample covers at least this many bytes' worth of
#: input (a small corpus is verified whole): the rate is raised to this share of the input.
VERIFY_FLOOR_BYTES = 64 * 1024


def verify_rate(fraction: float, input_bytes: int) -> float:
    """The share re-checked with HF: ``fraction`` (0: none) raised to ``VERIFY_FLOOR_BYTES``."""
    if fraction <= 0:
        return 0.0
    return min(1.0, max(fraction, VERIFY_FLOOR_BYTES / max(1, input_bytes)))


def source_salt(name: str) -> int:
    """The 64-bit salt ``sampled`` uses for the records of the input at path ``name``."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def build_draw_keys(
    records: np.ndarray, files: np.ndarray | None, names: tuple[str, ...]
) -> np.ndarray:
    """Each text's key for the build's verification sample (``sampled`` with salt 0).

    The key is the record index plus its file's salt, salted apart from ``verify --tokens``'
    sample. ``files`` indexes ``names`` per text (None: all in ``names[0]``).
    """
    salts = np.array([source_salt("build:" + n) for n in names or ("",)], dtype=np.uint64)
    per_text = salts[files] if files is not None else salts[0]
    with np.errstate(over="ignore"):
        return records.astype(np.uint64) + per_text


def sampled(records: np.ndarray, rate: float, salt: int) -> np.ndarray:
    """Which records are in the verification sample: a bool per record.

    A record is in when splitmix64 of ``salt`` and its index, read as a number in [0, 1), is
    below ``rate``: independent per record, and the same whatever the batching, the number of
    processes or a resume.
    """
    if rate >= 1:
        return np.ones(len(records), dtype=bool)
    with np.errstate(over="ignore"):
        z = records.astype(np.uint64) + np.uint64(salt) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) < rate * 2.0**53


#: Characters of sampled documents one background HF call verifies: the samples of many
#: batches go in one call, since every call also pays a thread start, GIL hand-overs and the
#: wake-up of HF's thread pool, which in a busy build outweigh encoding a few documents.
VERIFY_GROUP_CHARS = 64 * 1024

#: Groups whose verification may still run in the background while the encoder goes on.
VERIFY_AHEAD = 2


@dataclass
class SampledBatch:
    """One batch's verification sample: positions in the batch, texts and fast ids, copied."""

    positions: np.ndarray
    texts: list[str]
    tokens: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(
        cls, texts: list[str], tokens: np.ndarray, lengths: np.ndarray, positions: np.ndarray
    ) -> SampledBatch:
        """The sample at ``positions`` of a batch, as copies."""
        ends = np.cumsum(lengths)
        starts = ends - lengths
        picked = [tokens[starts[i] : ends[i]] for i in positions]
        flat = np.concatenate(picked) if picked else np.zeros(0, dtype=tokens.dtype)
        return cls(positions, [texts[i] for i in positions], flat, lengths[positions].copy())


def verify_group(
    group: list[SampledBatch], reference: HFBackend, add_special_tokens: bool
) -> list[VerifyCounts]:
    """Re-encode ``group``'s samples with HF in one call and compare with the fast ids.

    Gives each batch's counts. An HF failure is a mismatch of the batch it fails on (a failing
    group is re-run batch by batch to find it).
    """
    try:
        ref_tokens, ref_lengths = reference.encode_flat(
            [text for batch in group for text in batch.texts], add_special_tokens
        )
    except Exception as err:  # any HF failure is the batch's
        if len(group) > 1:  # find the batch it fails on
            return [c for batch in group for c in verify_group([batch], reference,
                                                               add_special_tokens)]  # fmt: skip
        detail = f"HF failed on the verification sample ({type(err).__name__}: {err})"[:300]
        return [VerifyCounts(mismatches=1, detail=[detail])]
    out = []
    docs = np.cumsum([0, *(len(batch.texts) for batch in group)])
    ends = np.cumsum(ref_lengths)
    for batch, first, last in zip(group, docs[:-1], docs[1:]):
        start = int(ends[first - 1]) if first else 0
        end = int(ends[last - 1]) if last else 0
        out.append(_compare_sample(batch, ref_tokens[start:end], ref_lengths[first:last]))
    return out


def _compare_sample(
    batch: SampledBatch, ref_tokens: np.ndarray, ref_lengths: np.ndarray
) -> VerifyCounts:
    counts = VerifyCounts(documents=len(batch.texts), tokens=int(ref_lengths.sum()))
    if np.array_equal(ref_lengths, batch.lengths) and np.array_equal(ref_tokens, batch.tokens):
        return counts
    ref_ends, ends = np.cumsum(ref_lengths), np.cumsum(batch.lengths)
    for j, i in enumerate(batch.positions):
        expected = ref_tokens[ref_ends[j] - ref_lengths[j] : ref_ends[j]]
        got = batch.tokens[ends[j] - batch.lengths[j] : ends[j]]
        if len(got) == len(expected) and np.array_equal(got, expected):
            continue
        counts.mismatches += 1
        a, b = expected, got
        text = batch.texts[j]
        diff = first_difference([text], (a, np.asarray([len(a)])), (b, np.asarray([len(b)])))
        counts.detail.append(f"document {int(i)} of the batch: {diff}")
    return counts


class SampleVerifier:
    """The in-build verification of an encoder's batches, in background threads.

    Samples are queued; every ``VERIFY_GROUP_CHARS`` of them go to ``verify_group`` in one
    thread, at most ``VERIFY_AHEAD`` groups behind the encoder. ``settle`` verifies the rest.
    """

    def __init__(self) -> None:
        self._queued: list[SampledBatch] = []
        self._chars = 0
        self._jobs: list[Ahead[list[VerifyCounts]]] = []
        self._how: tuple[Any, ...] = ()

    def add(
        self,
        sample: SampledBatch,
        reference: HFBackend,
        add_special_tokens: bool,
        times: Any = None,
    ) -> None:
        """Queue one batch's sample; ``times`` (a ``StageTimes``) gets ``verify_busy``."""
        self._queued.append(sample)
        self._chars += sum(map(len, sample.texts))
        self._how = (reference, add_special_tokens, times)
        if self._chars >= VERIFY_GROUP_CHARS:
            self._start()

    def _start(self) -> None:
        if len(self._jobs) >= VERIFY_AHEAD:  # backpressure
            self._jobs[-VERIFY_AHEAD].result()
        group, self._queued, self._chars = self._queued, [], 0
        self._jobs.append(Ahead(_verify_timed, group, *self._how))

    def settle(self) -> list[VerifyCounts]:
        """Verify what is queued, wait for every group and give each batch's counts."""
        if self._queued:
            self._start()
        jobs, self._jobs = self._jobs, []
        return [counts for job in jobs for counts in job.result()]


def _verify_timed(
    group: list[SampledBatch], reference: HFBackend, add_special_tokens: bool, times: Any
) -> list[VerifyCounts]:
    with times.busy("verify_busy") if times is not None else contextlib.nullcontext():
        return verify_group(group, reference, add_special_tokens)
