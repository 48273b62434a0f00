"""Content keys: a 64-bit hash of each document's content, the identity held-out splits draw.

A document's key is the first 8 bytes (little-endian) of the SHA-1 of its text's UTF-8 bytes,
or of the canonical JSON (sorted keys, no spaces) of a conversation or of a preference pair's
``(prompt, chosen, rejected)``: a well-mixed hash, not a security measure (SHA-1 is the fastest
of hashlib's hashes where the CPU has SHA instructions). It is computed once per record, before
the record is cut in pieces, and every sequence of the record (its pieces, a pair's two sides)
carries it. It depends on the content alone (not on the file, the record's position, the
tokenizer or the layout), so renaming, re-cutting or duplicating input files never gives one
document two keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np


def _content_bytes(document: Any) -> bytes:
    """A document's bytes: a text's UTF-8, else the canonical JSON of its structure."""
    if not isinstance(document, str):  # a conversation, or a pair's three parts
        # default=str: a columnar input's value JSON has no type for is hashed as its text
        document = json.dumps(
            document, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str
        )
    # a lone surrogate (legal in JSON strings) still has bytes, the same ones every time
    return document.encode("utf-8", "surrogatepass")


def content_keys(documents: Sequence[Any]) -> np.ndarray:
    """The content key of each document of a batch (uint64, one per document)."""
    digests = b"".join(
        hashlib.sha1(_content_bytes(d), usedforsecurity=False).digest()[:8] for d in documents
    )
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)
