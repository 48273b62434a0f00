"""Summaries of a cache for ``shardcache info``: a JSON-able dict, and its text.

Built from the manifest and the length index only: nothing here opens a shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardcache.errors import MissingDependencyError
from shardcache.store.cache import Cache


def human_bytes(n: float) -> str:
    """A byte count as a short string in binary units (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def cache_summary(cache: Cache) -> dict[str, Any]:
    """Everything ``shardcache info`` shows about a cache, as plain JSON."""
    m = cache.manifest
    lengths = np.asarray(cache.lengths, dtype=np.int64)
    buckets = cache.buckets()
    per_bucket = []
    for index, (low, high) in enumerate(m["buckets"]["ranges"]):
        mask = buckets == index
        per_bucket.append(
            {
                "bucket": index,
                "min_length": low,
                "max_length": high,
                "sequences": int(mask.sum()),
                "tokens": int(lengths[mask].sum()),
                "shards": int((cache.shard_buckets == index).sum()),
            }
        )
    truncation = {
        "max_length": m["options"]["tokenize"]["max_length"],
        "strategy": m["options"]["tokenize"]["truncation"],
    }
    prompt_limit = (m["options"].get("chat") or {}).get("max_prompt_length")
    if prompt_limit is not None:  # preference pairs: the prompt's own limit
        truncation["max_prompt_length"] = prompt_limit
    return {
        "path": cache.path,
        "format_version": m["format_version"],
        "shardcache_version": m["shardcache_version"],
        "tokenizer": m["tokenizer"],
        "dtype": m["dtype"],
        "truncation": truncation,
        "totals": m["totals"],
        "stats": m["stats"],
        "inputs": len(m["inputs"]),
        "buckets": per_bucket,
        "length": {
            "min": int(lengths.min()) if len(lengths) else 0,
            "mean": float(lengths.mean()) if len(lengths) else 0.0,
            "max": int(lengths.max()) if len(lengths) else 0,
        },
        "key_digest": (m.get("key") or {}).get("digest"),
        # what held-out splits draw documents by (caches built before content keys: path)
        "split_keys": "content" if "content_keys" in m["index"] else "path",
        "kind": m.get("kind", "text"),
        "encoder": m.get("encoder") or {},
    }


def encoder_lines(encoder: dict[str, Any]) -> list[str]:
    """``info`` lines on the encoder: backend, gate decision, in-build verification."""
    if not encoder or not encoder.get("versions"):
        return []
    by_backend = ", ".join(f"{k} {v}" for k, v in encoder["partitions_by_backend"].items())
    lines = [
        f"encoder      {', '.join(encoder['versions'])} (requested "
        f"{'/'.join(encoder['requested'])}; partitions: {by_backend})",
        *(f"encoder gate {reason}" for reason in encoder["gate"]),
    ]
    verified, mismatches = int(encoder["documents_verified"]), int(encoder["mismatches"])
    if verified or mismatches:
        redone = encoder["partitions_reencoded"]
        again = f", re-encoded with HF: {', '.join(redone)}" if redone else ""
        tokens = int(encoder.get("tokens_verified") or 0)
        rate = float(encoder.get("verify_fraction") or 0)
        drawn = f", a random {rate:.3g} of the documents" if 0 < rate < 1 else ""
        lines.append(
            f"verified     {verified:,} documents ({tokens:,} tokens{drawn}) re-encoded with HF "
            f"during the build, {mismatches:,} mismatches{again}"
        )
        bound = sample_bound(verified, mismatches, verified if rate >= 1 else None)
        if bound:
            lines.append(f"             {bound}")
    return lines


def sample_bound(checked: int, mismatches: int, total: int | None = None) -> str:
    """What a sample without mismatches says about the documents it did not check ("" otherwise).

    With 0 mismatches in ``checked`` random documents, fewer than ``3/checked`` of all differ at 95%
    confidence (the rule of three), which says nothing for 3 or fewer.
    """
    if mismatches or checked <= 0:
        return ""
    if total is not None and checked >= total:
        return f"0 mismatches in {checked:,} documents: every document was checked"
    if checked <= 3:  # 3/checked >= 100%: the rule of three bounds nothing
        return (
            f"0 mismatches in {checked:,} documents, too few to bound the others; "
            "`shardcache verify CACHE --tokens --fraction 1` checks every one"
        )
    return (
        f"0 mismatches in {checked:,} documents: fewer than 3/{checked:,} "
        f"({3 / checked:.2%}) of documents differ at 95% confidence; "
        "`shardcache verify CACHE --tokens --fraction 1` checks every one"
    )


def chat_lines(stats: dict[str, Any]) -> list[str]:
    """``info`` lines on trainable tokens and template lint (none for plain text)."""
    lint = stats.get("lint") or {}
    if not lint and not stats.get("trainable_tokens"):
        return []
    tokens = max(int(stats.get("tokens", 0)), 1)
    trainable = int(stats.get("trainable_tokens", 0))
    checked = lint.get("template_checked", 0)
    problems = ", ".join(f"{k} {v:,}" for k, v in lint.items() if k not in ("template_checked",))
    return [
        f"trainable    {trainable:,} tokens ({trainable / tokens:.1%}); dropped with no "
        f"trainable token: {int(stats.get('dropped_no_trainable', 0)):,}",
        f"chat lint    {problems} ({checked} conversations compared with apply_chat_template)",
    ]


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))
        )
        for r in rows
    )


def format_summary(s: dict[str, Any]) -> str:
    """The text ``shardcache info`` prints for a ``cache_summary`` (no final newline)."""
    t = s["totals"]
    st = s["stats"]
    tok = s["tokenizer"]
    trunc = s["truncation"]
    limit = trunc.get("max_prompt_length")  # preference pairs only
    prompt = f" max_prompt_length={limit}" if limit is not None else ""
    lines = [
        f"cache        {s['path']}",
        f"format       v{s['format_version']} (shardcache {s['shardcache_version']})",
        f"tokenizer    {tok['path']} ({tok['class']}, vocab {tok['vocab_size']}, "
        f"max id {tok['max_token_id']}, {s['dtype']})",
        f"truncation   max_length={trunc['max_length']} strategy={trunc['strategy']}{prompt}",
        f"inputs       {s['inputs']} files, {human_bytes(t['input_bytes'])}",
        f"documents    {t['documents']:,}",
        f"sequences    {t['sequences']:,}  (length min {s['length']['min']}, "
        f"mean {s['length']['mean']:.1f}, max {s['length']['max']})",
        f"tokens       {t['tokens']:,}",
        f"shards       {t['shards']:,}, {human_bytes(t['shard_bytes'])}",
        f"truncated    {st['truncated_documents']:,} docs, dropped {st['dropped_documents']:,}, "
        f"split {st['split_documents']:,}, empty {st['empty_documents']:,}, "
        f"lost tokens {st['lost_tokens']:,}",
    ]
    bad = st.get("bad_records") or {}
    bad_text = ", ".join(f"{k} {v:,}" for k, v in bad.items()) if bad else "none"
    lines.append(f"bad records  {bad_text}")
    lines += chat_lines(st)
    lines += encoder_lines(s.get("encoder") or {})
    if s.get("key_digest"):
        lines.append(f"key          {s['key_digest']}")
    if s.get("split_keys") == "content":
        lines.append("split keys   content (a hash of each document's text)")
    else:
        lines.append(
            "split keys   path keys (input file and record index): built before content keys, "
            "so a renamed, re-cut or duplicated input file moves or doubles documents across "
            "split sides; rebuild the cache for content keys"
        )
    rows = [("bucket", "lengths", "sequences", "tokens", "shards")]
    for b in s["buckets"]:
        high = "inf" if b["max_length"] is None else str(b["max_length"])
        rows.append(
            (
                str(b["bucket"]),
                f"{b['min_length']}-{high}",
                f"{b['sequences']:,}",
                f"{b['tokens']:,}",
                str(b["shards"]),
            )
        )
    return "\n".join(lines) + "\n\n" + _table(rows)


def length_histogram(cache: Cache, bins: int = 4) -> list[dict[str, Any]]:
    """Sequences and tokens per length bin, ``bins`` equal-width bins inside each bucket.

    A bucket's bins span its range (the last bucket's up to the longest sequence); empty
    buckets are left out. From the length index only.
    """
    lengths = np.asarray(cache.lengths, dtype=np.int64)
    buckets = cache.buckets()
    out = []
    for index, (low, high) in enumerate(cache.manifest["buckets"]["ranges"]):
        mine = lengths[buckets == index]
        if not len(mine):
            continue
        top = int(mine.max()) if high is None else int(high)
        edges = np.unique(np.linspace(int(low), top + 1, bins + 1).round().astype(np.int64))
        counts = np.histogram(mine, edges)[0]
        tokens = np.histogram(mine, edges, weights=mine)[0].astype(np.int64)
        for k in range(len(edges) - 1):
            out.append({"bucket": index, "min_length": int(edges[k]),
                        "max_length": int(edges[k + 1]) - 1, "sequences": int(counts[k]),
                        "tokens": int(tokens[k])})  # fmt: skip
    return out


def format_histogram(
    rows: list[dict[str, Any]], cost: dict[str, Any] | None, width: int = 40
) -> str:
    """The terminal histogram of ``length_histogram`` rows, with the pad cost per bucket."""
    most = max((r["sequences"] for r in rows), default=0) or 1
    per_bucket = (cost or {}).get("pad", {}).get("buckets", {})
    table: list[tuple[str, ...]] = [("bucket", "lengths", "sequences", "", "pad cost")]
    seen = set()
    for r in rows:
        bar = "#" * round(width * r["sequences"] / most) or ("." if r["sequences"] else "")
        padding = ""
        b = r["bucket"]
        if b not in seen and b in per_bucket:
            stats = per_bucket[b]
            padding = f"{stats['padding'] / max(stats['slots'], 1):.1%} of {stats['slots']:,}"
        label = str(b) if b not in seen else ""
        seen.add(b)
        table.append((label, f"{r['min_length']}-{r['max_length']}", f"{r['sequences']:,}",
                      bar.ljust(width), padding))  # fmt: skip
    lines = ["\n".join(line.rstrip() for line in _table(table).split("\n"))]
    if cost:
        pad, pack = cost["pad"], cost["pack"]
        lines.append(
            f"pad  max_tokens={cost['max_tokens']:,}: {pad['batches']:,} batches, "
            f"{pad['padding'] / max(pad['slots'], 1):.1%} of the slots are padding "
            f"({pad['padding']:,} tokens; pad cost: a bucket's share)"
        )
        lines.append(
            f"pack max_tokens={cost['max_tokens']:,} seq_len={pack['seq_len']:,} (best_fit): "
            f"{pack['rows']:,} rows in {pack['batches']:,} batches, {pack['fill']:.1%} of the "
            "slots hold tokens"
        )
    return "\n".join(lines)


def plot_histogram(rows: list[dict[str, Any]], path: str) -> None:
    """Write the length histogram as a PNG (needs matplotlib: ``MissingDependencyError``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise MissingDependencyError(
            f"--plot {path}: writing a PNG needs matplotlib; pip install 'shardcache[plot]' "
            "(or leave out --plot for the terminal histogram)"
        ) from err
    fig, ax = plt.subplots(figsize=(8, 4))
    lefts = [r["min_length"] for r in rows]
    widths = [r["max_length"] - r["min_length"] + 1 for r in rows]
    ax.bar(lefts, [r["sequences"] for r in rows], width=widths, align="edge",
           color=[f"C{r['bucket'] % 10}" for r in rows], edgecolor="black")  # fmt: skip
    ax.set_xlabel("sequence length (tokens); colour: bucket")
    ax.set_ylabel("sequences")
    if lefts and max(lefts) > 50 * max(min(lefts), 1):
        ax.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
