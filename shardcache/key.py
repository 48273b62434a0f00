"""The cache key: what makes two caches (or a cache and a lock file) interchangeable.

A :class:`CacheKey` is a set of named components, each a small JSON object:

===============  ====  ===============================================================
component        kind  fields
===============  ====  ===============================================================
tokenizer        hard  canonical backend content: normalizer, pre_tokenizer, model
                       (type, size, sha256 of its canonical JSON: vocab and merges),
                       post_processor, decoder, added_tokens (ids, flags), and the
                       backend's *saved* truncation / padding settings
special_tokens   hard  named special tokens with their ids; the end and pad ids used
behaviour        hard  ids the tokenizer emits for a fixed probe set (ASCII, CJK, emoji,
                       combining marks, whitespace runs, code, special-token strings)
template         hard  kind (text | chat), template source, options, BOS/EOS policy
truncation       hard  max_length, side, strategy
data             hard  per input file: relative path, size, sha256 (hashed while the
                       build reads it); or a user-given data version
versions         soft  transformers, tokenizers, FORMAT_VERSION, tokenizer class
===============  ====  ===============================================================

The digest is the sha256 of the canonical JSON (sorted keys, no whitespace) of the hard
components. Canonicalization goes through the *parsed* tokenizer, so reformatting
tokenizer.json (key order, whitespace) never changes the key, while any change in what the
tokenizer emits does (through its content or, for library upgrades, through the probe).
Every component is stored in full in the manifest; a value whose canonical JSON is longer
than :data:`INLINE_LIMIT` is stored as ``{"sha256", "bytes"}`` so manifests stay small.

Soft fields: a different library version alone is a warning when the behaviour probe gives
the same ids, and an error when it does not; ``strict=True`` makes any difference an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardcache.errors import CacheKeyMismatch, ConfigError, SourceError
from shardcache.format import FORMAT_VERSION

KEY_VERSION = 1
LOCK_VERSION = 1
HARD_COMPONENTS = ("tokenizer", "special_tokens", "behaviour", "template", "truncation", "data")
SOFT_COMPONENTS = ("versions",)
COMPONENTS = HARD_COMPONENTS + SOFT_COMPONENTS
INLINE_LIMIT = 2048

#: Fixed probe texts; changing them changes every key (bump KEY_VERSION if you do).
PROBES: dict[str, str] = {
    "ascii": "The quick brown fox jumps over the lazy dog. 0123456789 !?#$%&*()[]{}",
    "cjk": "東京は日本の首都です。数据处理和机器学习。한국어 텍스트",
    "emoji": "🙂👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    "combining": "e\u0301 n\u0303 A\u030a Ω\u0308 क्षि ﬁ Ⅻ",
    "whitespace": "a  b   c\t\td\n\ne \u00a0f\u2003g   \n\t ",
    "code": "def f(x):\n    return {'k': [x ** 2, x // 3]}  # comment\n\tif a != b: pass",
}


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _inline(value: Any) -> Any:
    """The value itself when small, else its digest and size."""
    text = canonical_json(value)
    if len(text) <= INLINE_LIMIT:
        return value
    return {"sha256": sha256_text(text), "bytes": len(text)}


@dataclass(frozen=True)
class Difference:
    """One changed field: ``component.field`` went from ``old`` to ``new``."""

    component: str
    field: str
    old: Any
    new: Any
    severity: str  # "changed" (incompatible) or "warning"

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "old": self.old, "new": self.new, "severity": self.severity}


@dataclass(frozen=True)
class CacheKey:
    """Named components (JSON objects) and their digest."""

    components: Mapping[str, Any]

    @property
    def digest(self) -> str:
        hard = {name: self.components.get(name) for name in HARD_COMPONENTS}
        return sha256_text(canonical_json({"key_version": KEY_VERSION, **hard}))

    def to_json(self) -> dict[str, Any]:
        return {
            "key_version": KEY_VERSION,
            "digest": self.digest,
            "components": {k: self.components.get(k) for k in COMPONENTS},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CacheKey:
        if not isinstance(data, Mapping) or "components" not in data:
            raise ConfigError("cache key: expected an object with 'components'; got something else")
        if data.get("key_version", KEY_VERSION) != KEY_VERSION:
            raise ConfigError(
                f"cache key: key_version {data.get('key_version')!r} is not supported "
                f"(this shardcache uses {KEY_VERSION}); rebuild or re-lock with this version"
            )
        return cls(dict(data["components"]))

    def with_component(self, name: str, value: Any) -> CacheKey:
        return CacheKey({**self.components, name: value})


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k in sorted(value):
            out.update(_flatten(value[k], f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _component_diff(name: str, old: Any, new: Any, severity: str) -> list[Difference]:
    if canonical_json(old) == canonical_json(new):
        return []
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return [Difference(name, "", old, new, severity)]
    a, b = _flatten(old), _flatten(new)
    diffs = []
    for path in sorted(set(a) | set(b)):
        va, vb = a.get(path, "<absent>"), b.get(path, "<absent>")
        if canonical_json(va) != canonical_json(vb):
            diffs.append(Difference(name, path, va, vb, severity))
    return diffs or [Difference(name, "", old, new, severity)]


@dataclass
class KeyComparison:
    """Per-component status: "same", "changed", "warning" or "skipped"."""

    expected: CacheKey
    actual: CacheKey
    status: dict[str, str] = field(default_factory=dict)
    differences: list[Difference] = field(default_factory=list)

    @property
    def compatible(self) -> bool:
        return all(s != "changed" for s in self.status.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "compatible": self.compatible,
            "expected_digest": self.expected.digest,
            "actual_digest": self.actual.digest,
            "components": {
                name: {
                    "status": self.status[name],
                    "differences": [d.to_json() for d in self.differences if d.component == name],
                }
                for name in COMPONENTS
            },
        }

    def describe(self, limit: int = 160) -> str:
        """A short human diff: one line per changed field, ``old -> new``."""
        lines = []
        for d in self.differences:
            where = f"{d.component}.{d.field}" if d.field else d.component
            tag = "warning" if d.severity == "warning" else "changed"
            lines.append(f"  {tag:8s} {where}: {_short(d.old, limit)} -> {_short(d.new, limit)}")
        skipped = [n for n, s in self.status.items() if s == "skipped"]
        if skipped:
            lines.append(f"  skipped  {', '.join(skipped)} (not given for the current side)")
        return "\n".join(lines)


def _short(value: Any, limit: int) -> str:
    text = canonical_json(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def compare(
    expected: CacheKey, actual: CacheKey, strict: bool = False, skip: tuple[str, ...] = ()
) -> KeyComparison:
    """Compare two keys component by component (``skip``: components not checked)."""
    result = KeyComparison(expected, actual)
    behaviour_same = canonical_json(expected.components.get("behaviour")) == canonical_json(
        actual.components.get("behaviour")
    )
    for name in COMPONENTS:
        if name in skip:
            result.status[name] = "skipped"
            continue
        soft = name in SOFT_COMPONENTS and behaviour_same and not strict
        diffs = _component_diff(
            name,
            expected.components.get(name),
            actual.components.get(name),
            "warning" if soft else "changed",
        )
        result.differences += diffs
        result.status[name] = "same" if not diffs else ("warning" if soft else "changed")
    return result


# --- building the components ---------------------------------------------------------------


def tokenizer_component(backend_json: Mapping[str, Any], truncation: Any, padding: Any) -> dict:
    """Canonical content of a backend tokenizer (parsed tokenizer.json) plus its saved
    truncation/padding settings as they were when loaded."""
    model = backend_json.get("model") or {}
    vocab = model.get("vocab")
    added = [
        {
            k: t.get(k)
            for k in ("id", "content", "special", "single_word", "lstrip", "rstrip", "normalized")
        }
        for t in backend_json.get("added_tokens") or []
    ]
    return {
        "normalizer": _inline(backend_json.get("normalizer")),
        "pre_tokenizer": _inline(backend_json.get("pre_tokenizer")),
        "model": {
            "type": model.get("type"),
            "vocab_size": len(vocab) if vocab is not None else None,
            "merges": len(model.get("merges") or []),
            "sha256": sha256_text(canonical_json(model)),
            "options": _inline({k: v for k, v in model.items() if k not in ("vocab", "merges")}),
        },
        "post_processor": _inline(backend_json.get("post_processor")),
        "decoder": _inline(backend_json.get("decoder")),
        "added_tokens": _inline(added),
        "truncation": truncation,
        "padding": padding,
    }


SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")  # fmt: skip


def special_tokens_component(hf: Any, end_id: int | None, pad_id: int) -> dict:
    named = {}
    for name in SPECIAL_NAMES:
        token = getattr(hf, name, None)
        if token is not None:
            named[name] = [str(token), hf.convert_tokens_to_ids(str(token))]
    extra = sorted(str(t) for t in (getattr(hf, "additional_special_tokens", None) or []))
    return {"named": named, "additional": _inline(extra), "end_id": end_id, "pad_id": pad_id}


def behaviour_component(encode: Any, special_strings: list[str], chat: str | None = None) -> dict:
    """Ids for the probe set through ``encode(list[str]) -> list[list[int]]``."""
    probes = dict(PROBES)
    if special_strings:
        probes["special_tokens"] = " ".join(special_strings) + " x" + "".join(special_strings)
    if chat is not None:
        probes["chat"] = chat
    names = sorted(probes)
    ids = encode([probes[n] for n in names])
    return {"probes_sha256": sha256_text(canonical_json(probes)),
            "ids": {n: _inline(list(map(int, i))) for n, i in zip(names, ids)}}  # fmt: skip


def truncation_component(max_length: int | None, strategy: str, side: str = "right") -> dict:
    return {"max_length": max_length, "strategy": strategy, "side": side}


def data_component_from_files(files: list[Mapping[str, Any]]) -> dict:
    """Files keyed by relative path, so a diff names the file that was edited/added/removed."""
    return {
        "mode": "files",
        "files": {f["relpath"]: {"size": f["size"], "sha256": f["sha256"]} for f in files},
    }


def data_component_from_version(version: str) -> dict:
    return {"mode": "version", "version": str(version)}


def versions_component(tokenizer_class: str) -> dict:
    import tokenizers
    import transformers

    return {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "format_version": FORMAT_VERSION,
        "tokenizer_class": tokenizer_class,
    }


# --- lock files ----------------------------------------------------------------------------


def write_lock(path: str, key: CacheKey) -> None:
    from shardcache.format import write_json_atomic

    write_json_atomic(path, {"shardcache_lock": LOCK_VERSION, "key": key.to_json()})


def read_lock(path: str) -> CacheKey:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise SourceError(f"lock file {path!r}: cannot read it ({err})") from err
    except ValueError as err:
        raise ConfigError(f"lock file {path!r}: not valid JSON ({err}); re-create it") from err
    if not isinstance(data, dict) or data.get("shardcache_lock") != LOCK_VERSION:
        raise ConfigError(
            f"lock file {path!r}: not a shardcache lock (version {LOCK_VERSION}); create one with "
            "`shardcache lock RECIPE -o shardcache.lock`"
        )
    return CacheKey.from_json(data["key"])


def manifest_key(manifest: Mapping[str, Any], where: str) -> CacheKey:
    if not manifest.get("key"):
        raise ConfigError(f"{where}: the manifest has no cache key; rebuild the cache")
    return CacheKey.from_json(manifest["key"])


def raise_if_mismatch(comparison: KeyComparison, where: str) -> None:
    """Raise :class:`CacheKeyMismatch` (listing the fields) unless compatible."""
    if comparison.compatible:
        return
    changed = [d for d in comparison.differences if d.severity == "changed"]
    fields = ", ".join(sorted({f"{d.component}.{d.field}".rstrip(".") for d in changed}))
    raise CacheKeyMismatch(
        f"{where}: the cache was built under a different key; changed: {fields}\n"
        f"{comparison.describe()}\nrebuild the cache with the current configuration, or point "
        "the reader at a cache built with it",
        [(d.component, d.field, d.old, d.new) for d in changed],
    )


def compute_key(encoder: Any, data: Mapping[str, Any] | None) -> CacheKey:
    """The key of a configuration: ``encoder`` is a :class:`~shardcache.tokenize.TextEncoder`
    (duck-typed here to keep this module free of tokenizer imports); ``data`` a data component
    or None when the data side is not known (then it is left out and not compared)."""
    text = getattr(encoder, "text", encoder)  # a ChatEncoder wraps a TextEncoder
    hf = text.hf
    options = text.options
    specials = [str(t) for t in getattr(hf, "all_special_tokens", []) or []]
    chat = encoder.probe_chat() if hasattr(encoder, "probe_chat") else None
    side = encoder.options.truncation_side if chat is not None else "right"
    return CacheKey(
        {
            "tokenizer": tokenizer_component(
                text.backend_json, text.backend_truncation, text.backend_padding
            ),
            "special_tokens": special_tokens_component(hf, text.eos_id, text.pad_id),
            "behaviour": behaviour_component(text.encode_texts, specials, chat),
            "template": encoder.template_component(),
            "truncation": truncation_component(options.max_length, options.truncation, side),
            "data": dict(data) if data is not None else None,
            "versions": versions_component(type(hf).__name__),
        }
    )


def expected_key(expect: Any) -> CacheKey:
    """``expect`` as a key: a :class:`CacheKey`, a lock file path, or a mapping of the
    tokenizer/template/truncation options (as in a recipe: tokenizer, max_length, ...)."""
    if isinstance(expect, CacheKey):
        return expect
    if isinstance(expect, (str, os.PathLike)):
        return read_lock(os.fspath(expect))
    if isinstance(expect, Mapping):
        from shardcache.check import DataHashing, current_key

        return current_key(expect, DataHashing())
    raise ConfigError(
        f"expect: got {type(expect).__name__}; give a CacheKey, a lock file path or a mapping "
        "of tokenizer options"
    )


def verify_manifest_key(manifest: Mapping[str, Any], expect: Any, where: str) -> CacheKey:
    """Raise :class:`CacheKeyMismatch` unless the cache's key matches ``expect``; returns
    the cache's key. Components missing on the expected side (e.g. data) are not compared."""
    recorded = manifest_key(manifest, where)
    wanted = expected_key(expect)
    skip = tuple(n for n in COMPONENTS if wanted.components.get(n) is None)
    raise_if_mismatch(compare(recorded, wanted, skip=skip), where)
    return recorded
