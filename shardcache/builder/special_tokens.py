"""The special tokens a tokenizer.json post-processor puts around a sequence.

For backends that encode without them: ``SpecialTokens.add`` puts them around flat ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import EncoderError


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a post-processor puts around one sequence, for libraries that encode without them.

    ``error`` is set for a post-processor this does not model: only builds with
    ``add_special_tokens=False`` can then use the library.
    """

    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    error: str | None = None

    @classmethod
    def of(cls, processor: Mapping[str, Any] | None) -> SpecialTokens:
        """The special tokens of a tokenizer.json ``post_processor`` (None: none)."""
        if processor is None:
            return cls()
        kind = processor.get("type")
        if kind == "ByteLevel":  # offsets only
            return cls()
        if kind in ("BertProcessing", "RobertaProcessing"):
            return cls((int(processor["cls"][1]),), (int(processor["sep"][1]),))
        if kind == "Sequence":
            parts = [cls.of(p) for p in processor.get("processors") or []]
            errors = [p.error for p in parts if p.error]
            if errors:
                return cls(error=errors[0])
            added = [p for p in parts if p.before or p.after]
            return added[0] if len(added) == 1 else cls() if not added else cls(error="several")
        if kind == "TemplateProcessing":
            before: list[int] = []
            after: list[int] = []
            side = before
            for piece in processor.get("single") or []:
                if "Sequence" in piece:
                    if side is after:
                        return cls(error="a template with the sequence twice")
                    side = after
                    continue
                name = piece.get("SpecialToken", {}).get("id")
                ids = (processor.get("special_tokens") or {}).get(name, {}).get("ids")
                if ids is None:
                    return cls(error=f"template token {name!r} without ids")
                side.extend(int(i) for i in ids)
            return cls(tuple(before), tuple(after))
        return cls(error=f"post-processor {kind!r}")

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Put ``before``/``after`` around each sequence; ``EncoderError`` when ``error`` is set."""
        if self.error is not None:
            raise EncoderError(f"cannot add this tokenizer's special tokens: {self.error}")
        if not self.before and not self.after:
            return tokens, lengths
        nb, na = len(self.before), len(self.after)
        out_lengths = lengths + nb + na
        starts = np.cumsum(out_lengths) - out_lengths
        out = np.empty(int(out_lengths.sum()), dtype=np.uint32)
        body = np.ones(len(out), dtype=bool)
        for k, token in enumerate(self.before):
            out[starts + k] = token
            body[starts + k] = False
        for k, token in enumerate(self.after):
            at = starts + out_lengths - na + k
            out[at] = token
            body[at] = False
        out[body] = tokens
        return out, out_lengths
