"""What a build reports: progress events while it runs (``Progress``), the report at the end."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shardcache.builder.stage_times import format_stages
from shardcache.store.layout import QUARANTINE
from shardcache.store.summary import chat_lines, encoder_lines, human_bytes


class Progress:
    """Receives build progress; no-op by default (the CLI subclasses it with a bar).

    In a parallel build the workers' events are forwarded to this object in the parent, so one
    bar covers the whole build.
    """

    def start(self, total_bytes: int, files: int) -> None:
        """Called once before any partition runs: input bytes still to read, input files."""

    def advance(self, n_bytes: int) -> None:
        """Called as raw input is consumed, with the bytes consumed since the last call."""

    def update(self, documents: int, tokens: int) -> None:
        """Called as sequences are written, with the documents and tokens just written."""

    def close(self) -> None:
        """Called once at the end, also on failure."""


@dataclass
class BuildReport:
    """The summary a build prints and returns.

    Attributes:
        output: the cache folder or URL.
        documents: documents kept.
        sequences: sequences stored (documents, or their pieces when split).
        tokens: tokens stored.
        shards: shard files of the cache.
        bytes_in: input bytes read.
        bytes_out: shard bytes written.
        seconds: wall-clock seconds of this run.
        stats: the manifest's build counters (truncation, chat lint).
        bad_records: skipped records by reason.
        partitions: partitions of the plan.
        resumed_partitions: partitions taken from an interrupted earlier run.
        workers: worker processes used.
        corrupt_files: damaged inputs and where their loss begins.
        up_to_date: nothing was done: the output already held this build, committed.
        encoder: the manifest's ``encoder`` field (backend chosen and its verification).
        stages: CPU seconds per stage of this run (see ``shardcache.builder.stage_times``).
    """

    output: str
    documents: int
    sequences: int
    tokens: int
    shards: int
    bytes_in: int
    bytes_out: int
    seconds: float
    stats: dict[str, int]
    bad_records: dict[str, int] = field(default_factory=dict)
    partitions: int = 0
    resumed_partitions: int = 0
    workers: int = 1
    corrupt_files: list[dict[str, Any]] = field(default_factory=list)
    up_to_date: bool = False
    encoder: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """Tokens stored per wall-clock second."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def report_from_manifest(
    output: str, manifest: Mapping[str, Any], seconds: float, up_to_date: bool = False
) -> BuildReport:
    """The report of a committed cache, from its manifest (``workers`` 0: none ran)."""
    totals, stats = manifest["totals"], dict(manifest["stats"])
    bad, corrupt = stats.pop("bad_records"), stats.pop("corrupt_files")
    return BuildReport(
        output=output, documents=totals["documents"], sequences=totals["sequences"],
        tokens=totals["tokens"], shards=totals["shards"], bytes_in=totals["input_bytes"],
        bytes_out=totals["shard_bytes"], seconds=seconds, stats=stats, bad_records=bad,
        partitions=manifest["partitions"], resumed_partitions=manifest["partitions"],
        workers=0, corrupt_files=corrupt, up_to_date=up_to_date,
        encoder=manifest.get("encoder") or {},
    )  # fmt: skip


def report_json(report: BuildReport) -> dict[str, Any]:
    """The report as plain JSON (``build --json``), with ``tokens_per_second``."""
    return {
        **asdict(report),
        "seconds": round(report.seconds, 3),
        "tokens_per_second": round(report.tokens_per_second, 1),
    }


def format_report(report: BuildReport, brief: bool = False) -> str:
    """The report as the aligned lines ``build`` prints, without a final newline.

    ``brief`` (``build -q``): one line, then a line per problem (bad records, lost input,
    tokens that differed from HF).
    """
    st = report.stats
    secs = max(report.seconds, 1e-9)
    bad = ", ".join(f"{k} {v:,}" for k, v in report.bad_records.items()) or "none"
    resumed = f", {report.resumed_partitions} resumed" if report.resumed_partitions else ""
    lost = [
        f"lost         {c['source']} from {'row' if 'row' in c else 'line'} {c['record'] + 1} "
        f"(offset ~{c['offset']}): "
        f"{c['excerpt']}"
        for c in report.corrupt_files
    ]
    if brief and not report.up_to_date:
        mismatches = int(report.encoder.get("mismatches") or 0)
        redone = ", ".join(report.encoder.get("partitions_reencoded") or [])
        return "\n".join(
            [
                f"built {report.output}: {report.documents:,} documents, {report.tokens:,} "
                f"tokens, {report.shards:,} shard(s) ({human_bytes(report.bytes_out)}) in "
                f"{report.seconds:.1f} s",
                *(
                    [f"bad records  {bad} (see {report.output.rstrip('/')}/{QUARANTINE})"]
                    if report.bad_records
                    else []
                ),
                *lost,
                *(
                    [f"verified     {mismatches:,} mismatches with HF, re-encoded: {redone}"]
                    if mismatches
                    else []
                ),
            ]
        )
    if report.up_to_date:
        return (
            f"up to date   {report.output}: already committed with these options and inputs "
            f"({report.documents:,} documents, {report.tokens:,} tokens); nothing to do"
        )
    return "\n".join(
        [
            f"built        {report.output}",
            f"partitions   {report.partitions}{resumed}, {report.workers} worker(s)",
            f"documents    {report.documents:,}",
            f"sequences    {report.sequences:,}",
            f"tokens       {report.tokens:,}",
            f"shards       {report.shards:,} ({human_bytes(report.bytes_out)})",
            f"truncated    {st['truncated_documents']:,} docs, dropped "
            f"{st['dropped_documents']:,}, split {st['split_documents']:,}, "
            f"lost tokens {st['lost_tokens']:,}",
            f"bad records  {bad}",
            *lost,
            *chat_lines(st),
            *encoder_lines(report.encoder),
            *format_stages(report.stages),
            f"time         {report.seconds:.1f} s: {report.tokens / secs:,.0f} tokens/s, "
            f"{report.bytes_in / secs / 1e6:.1f} MB/s in",
        ]
    )
