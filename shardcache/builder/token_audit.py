"""``shardcache verify --tokens``: re-tokenize stored documents with the HF tokenizer and compare.

A deterministic, hash-chosen sample of each input's records is encoded again with the HF
reference under the cache's own options and compared with the stored sequences of the same
provenance (ids and, for chat, masks); a sampled record missing on either side is a mismatch.
The tokenizer's key components must equal the cache's (``CacheKeyMismatch`` otherwise); a
changed behaviour probe is reported, not refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.builder.audit_pool import encode_in_order
from shardcache.builder.build_plan import options_from_json
from shardcache.builder.encoders import make_encoder
from shardcache.builder.key_computation import compute_key, precompute_tokenizer_component
from shardcache.builder.report import Progress
from shardcache.builder.sampled_verify import sampled, source_salt
from shardcache.builder.sources import FileDigest, iter_text_batches, list_inputs
from shardcache.errors import CacheKeyMismatch, SourceError
from shardcache.store.cache import Cache, Sequence, open_cache
from shardcache.store.check import cache_key, compare_keys
from shardcache.store.summary import sample_bound

#: Key components that must be equal for the audit to mean anything.
AUDITED_COMPONENTS = ("tokenizer", "special_tokens", "template", "truncation")


@dataclass
class TokenAudit:
    """What ``verify --tokens`` found.

    ``documents`` counts sampled records encoded again, ``sequences`` stored ones compared;
    each mismatch has ``source``, ``record``, ``piece`` and ``detail``.
    """

    path: str
    fraction: float
    documents: int = 0
    sequences: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    changed_inputs: list[str] = field(default_factory=list)
    missing_inputs: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    total_documents: int | None = None

    @property
    def ok(self) -> bool:
        """True when nothing mismatched and every input was found unchanged."""
        return not (self.mismatches or self.changed_inputs or self.missing_inputs)

    def to_json(self) -> dict[str, Any]:
        """The audit as ``verify --tokens --json`` prints it (the first 100 mismatches)."""
        return {
            "path": self.path,
            "ok": self.ok,
            "fraction": self.fraction,
            "documents": self.documents,
            "sequences": self.sequences,
            "mismatches": self.mismatches[:100],
            "mismatch_count": len(self.mismatches),
            "changed_inputs": self.changed_inputs,
            "missing_inputs": self.missing_inputs,
            "warnings": self.warnings,
            "sample_bound": sample_bound(
                self.documents, len(self.mismatches), self.total_documents
            ),
        }


def format_token_audit(audit: TokenAudit) -> str:
    """The audit as the aligned text ``verify --tokens`` prints (no final newline)."""
    lines = [
        f"cache        {audit.path}",
        f"tokens       {audit.documents:,} documents re-encoded with HF (fraction "
        f"{audit.fraction:g}), {audit.sequences:,} stored sequences compared",
        *(f"warning      {w}" for w in audit.warnings),
        *(f"missing      {m}: input not found (pass --input)" for m in audit.missing_inputs),
        *(f"changed      {c}: sha256 differs from the manifest" for c in audit.changed_inputs),
        *(
            f"mismatch     {m['source']} record {m['record']} piece {m['piece']}: {m['detail']}"
            for m in audit.mismatches[:20]
        ),
    ]
    if len(audit.mismatches) > 20:
        lines.append(f"mismatch     ... {len(audit.mismatches):,} in all (--json lists 100)")
    bound = sample_bound(audit.documents, len(audit.mismatches), audit.total_documents)
    if bound and audit.ok:
        lines.append(f"sample       {bound}")
    lines.append(
        "ok           stored ids equal the HF tokenizer's"
        if audit.ok
        else f"FAILED       {len(audit.mismatches):,} mismatches, "
        f"{len(audit.changed_inputs) + len(audit.missing_inputs)} unusable inputs"
    )
    return "\n".join(lines)


def _describe(expected: np.ndarray, stored: np.ndarray) -> str:
    n = min(len(expected), len(stored))
    differ = np.flatnonzero(expected[:n].astype(np.int64) != stored[:n].astype(np.int64))
    at = int(differ[0]) if len(differ) else n
    return (
        f"at token {at}: HF gives {expected[at : at + 4].tolist()} (of {len(expected)}), the "
        f"cache holds {stored[at : at + 4].tolist()} (of {len(stored)})"
    )


def audit_tokens(
    path: str,
    fraction: float,
    inputs: tuple[str, ...] | None = None,
    tokenizer: str | None = None,
    workers: int = 1,
    progress: Progress | None = None,
) -> TokenAudit:
    """Re-encode ``fraction`` of each input's records of the cache at ``path`` with HF; compare.

    ``inputs`` and ``tokenizer`` replace the manifest's paths (data moved since the build); the
    audit is the same for any number of ``workers``. Raises ``CacheKeyMismatch`` when the
    tokenizer's key components differ from the cache's; missing or changed inputs are reported
    in the audit, not raised.
    """
    cache = open_cache(path)
    manifest = cache.manifest
    options = options_from_json(manifest["options"], path)
    if inputs:
        options = dataclasses.replace(
            options, source=dataclasses.replace(options.source, inputs=tuple(inputs))
        )
    if tokenizer:
        options = dataclasses.replace(
            options, tokenize=dataclasses.replace(options.tokenize, tokenizer=tokenizer)
        )
    # HF, the reference, resolved from the tokenizer's files: an audit never reads a memo
    encoder = make_encoder(options.tokenize, options.chat, audit=True)
    precompute_tokenizer_component(encoder, use_memo=False)
    audit = TokenAudit(path=path, fraction=fraction)
    documents = (manifest.get("totals") or {}).get("documents")
    audit.total_documents = documents if isinstance(documents, int) else None
    comparison = compare_keys(cache_key(path), compute_key(encoder, None), strict=False)
    changed = [d for d in comparison.differences
               if d.component in AUDITED_COMPONENTS and d.severity == "changed"]  # fmt: skip
    if changed:
        raise CacheKeyMismatch(
            f"verify --tokens {path!r}: the tokenizer/template/truncation given now differ "
            f"from the cache's ({comparison.describe()}); an audit needs the tokenizer the "
            "cache was built with: pass --tokenizer with that folder",
            [(d.component, d.field, d.old, d.new) for d in changed],
        )
    if comparison.status.get("behaviour") not in (None, "same", "skipped"):
        audit.warnings.append(
            "the behaviour probe differs from the cache's (tokenizers/transformers changed "
            "since the build?): mismatches below show where the ids changed"
        )

    # a digest per sampled sequence, not its ids: memory stays small for a full audit
    stored: dict[tuple[str, int, int], tuple[int, bytes, bytes]] = {}

    def keep_sampled(run: list[Sequence]) -> None:  # sequences of one input
        source = run[0].provenance.source
        records = np.fromiter((seq.provenance.record for seq in run), np.int64, len(run))
        for seq in itertools.compress(run, sampled(records, fraction, source_salt(source))):
            p = seq.provenance
            stored[(p.source, p.record, p.piece)] = (seq.sample_id, *_digests(seq.ids, seq.mask))

    run: list[Sequence] = []
    for seq in cache.iter_sequences():
        if run and (seq.provenance.source != run[0].provenance.source or len(run) >= 4096):
            keep_sampled(run)
            run = []
        run.append(seq)
    if run:
        keep_sampled(run)

    recorded = {f["relpath"]: f for f in manifest["inputs"]}
    found = {}
    existing = [s for s in options.source.inputs if os.path.exists(s) or glob.glob(s)]
    with contextlib.suppress(SourceError):  # inputs that are gone are reported missing
        found = {f.relpath: f for f in list_inputs(existing)} if existing else {}
    audit.missing_inputs = sorted(set(recorded) - set(found))
    kind = options.kind  # text, chat or preference: how records are read and validated
    names = sorted(set(recorded) & set(found))
    digests = {relpath: FileDigest() for relpath in names}
    progress = progress or Progress()
    progress.start(sum(found[relpath].size for relpath in names), len(names))

    def jobs() -> Iterator[tuple[tuple[str, np.ndarray], list[Any]]]:
        for relpath in names:
            for batch in iter_text_batches(found[relpath], text_field=options.source.text_field,
                                           batch_docs=options.batch_docs, on_error="skip",
                                           on_bytes=progress.advance, digest=digests[relpath],
                                           on_corrupt=lambda *a: None, kind=kind):  # fmt: skip
                pick = np.flatnonzero(sampled(batch.records, fraction, source_salt(relpath)))
                if len(pick):
                    yield (relpath, batch.records[pick]), [batch.texts[i] for i in pick]

    encoded_batches = encode_in_order(encoder, jobs(), workers, options.tokenize, options.chat)
    for (relpath, records), encoded in encoded_batches:
        audit.documents += len(records)
        progress.update(len(records), int(encoded.lengths.sum()))
        ends = np.cumsum(encoded.lengths)
        for j, (doc, piece) in enumerate(zip(encoded.doc_index, encoded.piece)):
            key = (relpath, int(records[doc]), int(piece))
            start = ends[j] - encoded.lengths[j]
            expected = encoded.tokens[start : ends[j]]
            mask = None if encoded.mask is None else encoded.mask[start : ends[j]]
            _compare(audit, cache, key, expected, mask, stored.pop(key, None))
    for relpath in names:
        sha = digests[relpath].sha256
        if sha and sha != recorded[relpath]["sha256"]:
            audit.changed_inputs.append(relpath)
    for key in sorted(k for k in stored if k[0] in found):
        audit.mismatches.append({"source": key[0], "record": key[1], "piece": key[2],
                                 "detail": "stored, but HF produces no such sequence"})  # fmt: skip
    return audit


def _digests(ids: np.ndarray, mask: np.ndarray | None) -> tuple[bytes, bytes]:
    """Digests of a sequence's ids (as uint32, whatever the cache's dtype) and loss mask."""
    id_digest = hashlib.blake2b(np.asarray(ids, dtype=np.uint32).tobytes(), digest_size=16)
    if mask is None:
        return id_digest.digest(), b""
    mask_digest = hashlib.blake2b(np.asarray(mask, dtype=bool).tobytes(), digest_size=16)
    return id_digest.digest(), mask_digest.digest()


def _compare(
    audit: TokenAudit,
    cache: Cache,
    key: tuple[str, int, int],
    expected: np.ndarray,
    mask: np.ndarray | None,
    stored: tuple[int, bytes, bytes] | None,
) -> None:
    source, record, piece = key
    if stored is None:
        detail = "HF produces this sequence, but the cache does not hold it"
    else:
        audit.sequences += 1
        sample_id, stored_ids, stored_mask = stored
        ids_digest, mask_digest = _digests(expected, mask)
        if ids_digest == stored_ids and (not mask_digest or not stored_mask
                                         or mask_digest == stored_mask):  # fmt: skip
            return
        ids = cache.read(sample_id)  # a difference: read the stored sequence to describe it
        equal = len(ids) == len(expected) and np.array_equal(ids, expected)
        detail = "ids equal, loss masks differ" if equal else _describe(expected, ids)
    audit.mismatches.append({"source": source, "record": record, "piece": piece,
                             "detail": detail})  # fmt: skip
