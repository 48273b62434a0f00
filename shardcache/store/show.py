"""What ``shardcache show`` prints: which sequences, where they came from, their trainable runs.

No tokenizer here (the store never imports one): rendering takes a ``decode(ids) -> str``
callable from the caller. A run is a stretch of consecutive tokens that all have, or all lack,
a loss; trainable runs are marked with colour on a terminal, ``[[...]]`` otherwise. A cache
with per-token columns (``store/columns.py``: loss weights) also cuts runs where a column's value
changes, and a trainable run whose value is not the column's ``trained`` one is followed by its
tag (``{w=...}``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import ConfigError
from shardcache.store.cache import Cache, shard_runs
from shardcache.store.columns import TOKEN_COLUMNS

#: Decodes token ids to text (the CLI passes the cache's tokenizer).
Decode = Callable[[Sequence[int]], str]

#: What marks a trainable run when there is no colour.
OPEN, CLOSE = "[[", "]]"
#: What separates tokens when boundaries are asked for.
BOUNDARY = "\u2502"  # a box-drawing bar: "|" is in ChatML tokens (<|im_end|>)
#: ANSI styles of trainable tokens and of padding on a terminal.
TRAINABLE_STYLE = ("\x1b[1;32m", "\x1b[0m")
PADDING_STYLE = ("\x1b[2m", "\x1b[0m")


@dataclass(frozen=True)
class RenderOptions:
    """How runs become text: ``color`` (ANSI) or brackets, and token boundaries."""

    color: bool = False
    boundaries: bool = False


def source_sample_ids(cache: Cache, source: str) -> np.ndarray:
    """The sample ids of the sequences from input file ``source``, from the manifest alone."""
    found = []
    for index, info in enumerate(cache.shards):
        row = int(cache.shard_starts[index])
        for name, rows in shard_runs(info):
            if name == source:
                found.append(np.arange(row, row + rows, dtype=np.int64))
            row += rows
    if not found:
        names = sorted({str(i["relpath"]) for i in cache.manifest.get("inputs", [])})
        shown = ", ".join(names[:10]) + (f" ... ({len(names)} in all)" if len(names) > 10 else "")
        raise ConfigError(
            f"--source {source!r}: no sequence of the cache came from it; the inputs are "
            f"{shown or '(none)'} (paths relative to the build's input root)"
        )
    return np.sort(np.concatenate(found))


def provenance_of(cache: Cache, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The record and piece index of each sample id (reads the shards they are in)."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    records = np.zeros(len(ids), dtype=np.int64)
    pieces = np.zeros(len(ids), dtype=np.int64)
    shard_of = np.searchsorted(cache.shard_starts, ids, side="right") - 1
    for shard in np.unique(shard_of).tolist():
        at = shard_of == shard
        shard_records, shard_pieces = cache.shard_provenance(shard)
        rows = ids[at] - cache.shard_starts[shard]
        records[at], pieces[at] = shard_records[rows], shard_pieces[rows]
    return records, pieces


def document_pieces(cache: Cache, source: str, record: int) -> np.ndarray:
    """The sample ids of every piece of one document, in piece order (one unless split)."""
    ids = source_sample_ids(cache, source)
    records, pieces = provenance_of(cache, ids)
    mine = records == record
    return ids[mine][np.argsort(pieces[mine], kind="stable")]


def select_samples(
    cache: Cache,
    indices: Sequence[int] = (),
    sample: int | None = None,
    seed: int = 0,
    source: str | None = None,
    record: int | None = None,
) -> np.ndarray:
    """The sample ids ``show`` prints, in order.

    Explicit ``indices`` win; else the pool is the cache, or ``source`` (and its ``record``'s
    pieces), from which ``sample`` draws that many at random (seeded), or takes the first 3.
    """
    n = cache.num_sequences
    if indices:
        ids = np.asarray(indices, dtype=np.int64)
        bad = ids[(ids < 0) | (ids >= n)]
        if len(bad):
            raise ConfigError(
                f"--index {int(bad[0])}: out of range, the cache holds {n} sequences "
                f"(sample ids 0..{n - 1})"
            )
        return ids
    if record is not None and source is None:
        raise ConfigError("--record: needs --source FILE (the record's input file)")
    if source is None:
        pool = np.arange(n, dtype=np.int64)
    elif record is None:
        pool = source_sample_ids(cache, source)
    else:
        pool = document_pieces(cache, source, record)
        if not len(pool):
            raise ConfigError(
                f"--source {source!r} --record {record}: no sequence of the cache holds that "
                "record (dropped, empty or bad at build time: see `shardcache info`)"
            )
        return pool
    if sample is None:
        return pool[:3]
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(pool, size=min(sample, len(pool)), replace=False))


def mask_runs(mask: np.ndarray, columns: Sequence[np.ndarray] = ()) -> list[tuple[int, int, bool]]:
    """``(start, end, trainable)`` of each run of equal mask values (and equal ``columns``)."""
    mask = np.asarray(mask, dtype=bool)
    if not len(mask):
        return []
    change = mask[1:] != mask[:-1]
    for values in columns:
        change |= values[1:] != values[:-1]
    cuts = np.flatnonzero(change) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(mask)]))
    return [(int(s), int(e), bool(mask[s])) for s, e in zip(starts, ends)]


def _marking(options: RenderOptions) -> str:
    return "in colour" if options.color else f"{OPEN} {CLOSE}"


def _style(text: str, style: tuple[str, str]) -> str:
    return f"{style[0]}{text}{style[1]}"


def run_texts(ids: np.ndarray, decode: Decode, boundaries: bool) -> list[str]:
    """The text of a run: decoded whole, or token by token joined by ``BOUNDARY``."""
    values = np.asarray(ids).tolist()
    if not boundaries:
        return [decode(values)]
    return [decode([value]) for value in values]


def render_tokens(
    ids: np.ndarray,
    mask: np.ndarray | None,
    decode: Decode,
    options: RenderOptions,
    extras: Mapping[str, np.ndarray] | None = None,
) -> str:
    """One sequence as text, trainable runs marked (``mask`` None: nothing is marked).

    With ``extras`` (per-token columns by name) a trainable run whose value of a column is not
    its ``trained`` one is followed by the column's tag (``{w=...}``).
    """
    ids = np.asarray(ids)
    plain = mask is None
    extras = {} if plain or extras is None else extras
    flags = np.ones(len(ids), bool) if plain else np.asarray(mask, dtype=bool)
    runs = mask_runs(flags, list(extras.values()))
    parts = []
    for start, end, trainable in runs:
        text = BOUNDARY.join(run_texts(ids[start:end], decode, options.boundaries))
        if plain or not trainable:
            parts.append(text)
            continue
        if options.color:
            parts.append(_style(text, TRAINABLE_STYLE))
        else:
            parts.append(f"{OPEN}{text}{CLOSE}")
        for name, values in extras.items():
            spec, value = TOKEN_COLUMNS[name], values[start].item()
            if value != spec.trained:
                tag = f"{{{spec.tag}={value:g}}}"
                parts.append(_style(tag, PADDING_STYLE) if options.color else tag)
    return BOUNDARY.join(parts) if options.boundaries else "".join(parts)


def runs_json(
    ids: np.ndarray,
    mask: np.ndarray | None,
    decode: Decode,
    boundaries: bool,
    extras: Mapping[str, np.ndarray] | None = None,
) -> list[dict[str, Any]]:
    """The runs of a sequence as JSON: start, end, trainable, text (and tokens on request).

    With ``extras`` (per-token columns by name) runs also cut where a value changes, and each
    has its value under the column's ``run_key`` (``weight``).
    """
    ids = np.asarray(ids)
    extras = extras or {}
    flags = np.ones(len(ids), bool) if mask is None else np.asarray(mask, dtype=bool)
    out = []
    for start, end, trainable in mask_runs(flags, list(extras.values())):
        run: dict[str, Any] = {"start": start, "end": end, "trainable": trainable,
                               "text": decode(ids[start:end].tolist())}  # fmt: skip
        for name, values in extras.items():
            run[TOKEN_COLUMNS[name].run_key] = values[start].item()
        if boundaries:
            run["tokens"] = run_texts(ids[start:end], decode, True)
        out.append(run)
    return out


def sequence_json(
    cache: Cache, sample_id: int, decode: Decode, boundaries: bool = False
) -> dict[str, Any]:
    """One sequence for ``show --json``: provenance, its document's pieces, ids, mask, runs."""
    ids = np.asarray(cache.read(sample_id))
    mask = cache.read_masks(np.array([sample_id]))[0] if cache.has_mask else None
    extras = {name: cache.read_column(name, np.array([sample_id]))[0] for name in cache.columns}
    where = cache.lookup(sample_id)
    pieces = document_pieces(cache, where.source, where.record)
    shard = int(np.searchsorted(cache.shard_starts, sample_id, side="right")) - 1
    entry = {
        "sample_id": sample_id,
        "source": where.source,
        "record": where.record,
        "line": where.line,
        "piece": where.piece,
        "pieces": pieces.tolist(),
        "bucket": int(cache.shard_buckets[shard]),
        "length": len(ids),
        "trainable": len(ids) if mask is None else int(mask.sum()),
        "ids": ids.tolist(),
        "mask": None if mask is None else mask.astype(int).tolist(),
        "text": decode(ids.tolist()),
        "runs": runs_json(ids, mask, decode, boundaries, extras),
    }
    for name, values in extras.items():  # each per-token column the cache stores
        entry[name] = values.tolist()
    return entry


def format_sequence(entry: dict[str, Any], decode: Decode, options: RenderOptions) -> str:
    """The text ``show`` prints for one ``sequence_json`` entry."""
    pieces = entry["pieces"]
    piece = (
        f"piece {entry['piece']} of 0..{len(pieces) - 1} (sample ids {', '.join(map(str, pieces))})"
    )
    trainable = (
        "plain text: every token has a loss"
        if entry["mask"] is None
        else f"{entry['trainable']} trainable, marked {_marking(options)}"
    )
    extras = {}
    for name, spec in TOKEN_COLUMNS.items():
        if entry.get(name) is not None:
            shown = f"{{{spec.tag}=...}}"
            trainable += f", {spec.singular} other than {spec.trained:g} shown as {shown}"
            extras[name] = np.asarray(entry[name], dtype=spec.dtype)
    head = (
        f"#{entry['sample_id']}  {entry['source']} line {entry['line']} (record "
        f"{entry['record']}){', ' + piece if len(pieces) > 1 else ''}  ·  "
        f"{entry['length']} tokens, {trainable}  ·  bucket {entry['bucket']}"
    )
    mask = None if entry["mask"] is None else np.asarray(entry["mask"], dtype=bool)
    return head + "\n" + render_tokens(np.asarray(entry["ids"]), mask, decode, options, extras)


def batch_segments(
    input_ids: np.ndarray, meta: dict[str, Any], attention_mask: np.ndarray | None
) -> list[tuple[int, int, int, int]]:
    """``(row, start, end, sample id)`` of each segment of a batch; sample id -1: padding.

    Pad mode (``attention_mask`` given): a row is its sequence then padding. Pack mode: the
    segments are ``meta["cu_seqlens"]`` over the flattened rows, ``meta["sample_ids"]`` each.
    """
    rows, width = input_ids.shape
    sample_ids = np.asarray(meta["sample_ids"]).tolist()
    out = []
    if attention_mask is not None and attention_mask.ndim == 2:
        real = np.asarray(attention_mask).sum(axis=1).tolist()
        for row in range(rows):
            out.append((row, 0, int(real[row]), int(sample_ids[row])))
            if real[row] < width:
                out.append((row, int(real[row]), width, -1))
        return out
    cu = np.asarray(meta["cu_seqlens"], dtype=np.int64).tolist()
    for k in range(len(cu) - 1):
        row, start = divmod(cu[k], width)
        out.append((row, start, start + cu[k + 1] - cu[k], int(sample_ids[k])))
    return out


def batch_json(
    cache: Cache, batch: dict[str, Any], decode: Decode, boundaries: bool = False
) -> dict[str, Any]:
    """A collated batch for ``show --batch --json``: its rows' segments, as the model sees them.

    ``batch`` holds numpy arrays: ``input_ids``, ``labels``, ``attention_mask`` (pad mode) and
    ``meta``, and the per-token columns' arrays by batch key (``loss_weights``). A token is
    trainable where its label is not -100.
    """
    ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["labels"])
    laid = {
        n: np.asarray(batch[c.batch_key]) for n, c in TOKEN_COLUMNS.items() if c.batch_key in batch
    }
    mask = batch.get("attention_mask")
    mask = None if mask is None else np.asarray(mask)
    offsets = batch["meta"].get("sample_offsets")
    rows: list[dict[str, Any]] = [{"row": r, "segments": []} for r in range(ids.shape[0])]
    for k, (row, start, end, sample_id) in enumerate(batch_segments(ids, batch["meta"], mask)):
        tokens = ids[row, start:end]
        trained = labels[row, start:end] != -100
        segment: dict[str, Any] = {"start": start, "end": end, "sample_id": None}
        if sample_id >= 0:
            where = cache.lookup(sample_id)
            segment.update(sample_id=sample_id, source=where.source, line=where.line,
                           piece=where.piece)  # fmt: skip
            if offsets is not None:
                segment["offset"] = int(np.asarray(offsets)[k])
        extras = {name: values[row, start:end] for name, values in laid.items()}
        segment.update(
            padding=sample_id < 0,
            trainable=int(trained.sum()),
            ids=tokens.tolist(),
            labels=labels[row, start:end].tolist(),
            runs=runs_json(tokens, trained, decode, boundaries, extras) if sample_id >= 0 else [],
        )
        for name, values in extras.items():
            segment[TOKEN_COLUMNS[name].batch_key] = values.tolist()
        rows[row]["segments"].append(segment)
    shape = list(ids.shape)
    return {"shape": shape, "num_tokens": int(batch["meta"]["num_tokens"]), "rows": rows}


def format_batch(data: dict[str, Any], decode: Decode, options: RenderOptions) -> str:
    """The text ``show --batch`` prints for a ``batch_json``: rows, documents, padding."""
    rows, width = data["shape"]
    slots = rows * width
    lines = [
        f"batch of {rows} rows x {width} tokens: {data['num_tokens']} tokens, "
        f"{slots - data['num_tokens']} padding ({data['num_tokens'] / max(slots, 1):.1%} full); "
        f"tokens with a label marked {_marking(options)}"
    ]
    for row in data["rows"]:
        lines.append(f"--- row {row['row']}")
        for seg in row["segments"]:
            span = f"[{seg['start']}:{seg['end']}]"
            if seg["padding"]:
                pad = f"<padding x {seg['end'] - seg['start']}>"
                lines.append(f"  {span} " + (_style(pad, PADDING_STYLE) if options.color else pad))
                continue
            offset = f" from token {seg['offset']}" if seg.get("offset") else ""
            lines.append(
                f"  {span} #{seg['sample_id']} {seg['source']} line {seg['line']} piece "
                f"{seg['piece']}{offset}, {seg['trainable']} with a label"
            )
            ids = np.asarray(seg["ids"])
            trained = np.asarray(seg["labels"]) != -100
            extras = {n: np.asarray(seg[c.batch_key], dtype=c.dtype)
                      for n, c in TOKEN_COLUMNS.items() if c.batch_key in seg}  # fmt: skip
            text = render_tokens(ids, trained, decode, options, extras)
            lines.append("    " + text.replace("\n", "\n    "))
    return "\n".join(lines)
