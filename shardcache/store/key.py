"""The cache key: what makes two caches (or a cache and a lock file) interchangeable.

The digest covers the hard components (``tokenizer``, ``special_tokens``, ``behaviour``: the ids
of a fixed probe set, ``template``, ``truncation``, ``data``), not the soft ``versions``. Every
component is stored in the manifest (past ``INLINE_LIMIT`` as a digest), so a mismatch names the
field. A version difference alone only warns when the probe ids agree, unless ``strict``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardcache.errors import CacheKeyMismatch, ConfigError, SourceError
from shardcache.store.files import sha256_text, write_json_atomic

KEY_VERSION = 1
LOCK_VERSION = 1
HARD_COMPONENTS = ("tokenizer", "special_tokens", "behaviour", "template", "truncation", "data")
SOFT_COMPONENTS = ("versions",)
COMPONENTS = HARD_COMPONENTS + SOFT_COMPONENTS
INLINE_LIMIT = 2048


def canonical_json(value: Any) -> str:
    """A value as canonical JSON (sorted keys, no whitespace): what digests are taken of."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def inline_value(value: Any) -> Any:
    """A value as a component records it: itself, or ``{"sha256", "bytes"}`` when large."""
    text = canonical_json(value)
    if len(text) <= INLINE_LIMIT:
        return value
    return {"sha256": sha256_text(text), "bytes": len(text)}


@dataclass(frozen=True)
class Difference:
    """One changed field (``field`` "": the whole component); ``severity``: "changed", "warning"."""

    component: str
    field: str
    old: Any
    new: Any
    severity: str

    def to_json(self) -> dict[str, Any]:
        """The difference as JSON."""
        return {"field": self.field, "old": self.old, "new": self.new, "severity": self.severity}


@dataclass(frozen=True)
class CacheKey:
    """Named components (JSON values; None: not known) and their digest."""

    components: Mapping[str, Any]

    @property
    def digest(self) -> str:
        """The sha256 of the canonical JSON of the hard components."""
        hard = {name: self.components.get(name) for name in HARD_COMPONENTS}
        return sha256_text(canonical_json({"key_version": KEY_VERSION, **hard}))

    def to_json(self) -> dict[str, Any]:
        """The key as stored in a manifest or lock file."""
        return {
            "key_version": KEY_VERSION,
            "digest": self.digest,
            "components": {k: self.components.get(k) for k in COMPONENTS},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CacheKey:
        """The key ``to_json`` gave (ConfigError for another shape or key version)."""
        if not isinstance(data, Mapping) or "components" not in data:
            raise ConfigError("cache key: expected an object with 'components'; got something else")
        if data.get("key_version", KEY_VERSION) != KEY_VERSION:
            raise ConfigError(
                f"cache key: key_version {data.get('key_version')!r} is not supported "
                f"(this shardcache uses {KEY_VERSION}); rebuild or re-lock with this version"
            )
        components = dict(data["components"])
        for name, fields in PROVENANCE_FIELDS.items():
            value = components.get(name)
            if isinstance(value, Mapping) and any(f in value for f in fields):
                components[name] = {k: v for k, v in value.items() if k not in fields}
        return cls(components)

    def with_component(self, name: str, value: Any) -> CacheKey:
        """A copy with one component replaced."""
        return CacheKey({**self.components, name: value})


#: A field one side of a difference lacks: ``"<absent>"`` in JSON, ``(absent)`` in ``describe``.
ABSENT = "<absent>"

#: Fields keys once recorded that say where a value came from, not what it is: dropped when a
#: recorded key is read, so an old cache or lock compares (and digests) as a new one would.
PROVENANCE_FIELDS = {"template": ("template_from",)}


def _field_diff(name: str, path: str, old: Any, new: Any, severity: str) -> list[Difference]:
    """The differences under ``path``: per field where both sides are objects, else whole."""
    if canonical_json(old) == canonical_json(new):
        return []
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return [Difference(name, path, old, new, severity)]
    diffs: list[Difference] = []
    for k in sorted(set(old) | set(new), key=str):
        sub = f"{path}.{k}" if path else str(k)
        diffs += _field_diff(name, sub, old.get(k, ABSENT), new.get(k, ABSENT), severity)
    return diffs


def _component_diff(name: str, old: Any, new: Any, severity: str) -> list[Difference]:
    return _field_diff(name, "", old, new, severity)


@dataclass
class KeyComparison:
    """How two keys compare: per component "same", "changed", "warning" or "skipped"."""

    expected: CacheKey
    actual: CacheKey
    status: dict[str, str] = field(default_factory=dict)
    differences: list[Difference] = field(default_factory=list)

    @property
    def compared_digest(self) -> str:
        """The current side's digest with the skipped components taken from the recorded side.

        Equal to ``expected.digest`` exactly when every compared hard component is the same.
        """
        skipped = {n: self.expected.components.get(n) for n, s in self.status.items()
                   if s == "skipped"}  # fmt: skip
        return CacheKey({**self.actual.components, **skipped}).digest

    @property
    def compatible(self) -> bool:
        """True when no component is "changed" (warnings and skipped ones are compatible)."""
        return all(s != "changed" for s in self.status.values())

    def to_json(self) -> dict[str, Any]:
        """The comparison as JSON (``shardcache check --json``)."""
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
        """A short human diff: a line per changed field (values cut to ``limit``), skipped ones."""
        lines = []
        for d in self.differences:
            where = f"{d.component}.{d.field}" if d.field else d.component
            tag = "warning" if d.severity == "warning" else "changed"
            old, new = _short(d.old, limit), _short(d.new, limit)
            lines.append(f"  {tag:8s} {where}: {old} -> {new}")
        skipped = [n for n, s in self.status.items() if s == "skipped"]
        if skipped:
            lines.append(f"  skipped  {', '.join(skipped)} (not given for the current side)")
        return "\n".join(lines)


def _short(value: Any, limit: int) -> str:
    if isinstance(value, str) and value == ABSENT:
        return "(absent)"
    text = canonical_json(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def compare(
    expected: CacheKey, actual: CacheKey, strict: bool = False, skip: tuple[str, ...] = ()
) -> KeyComparison:
    """Compare two keys per component (soft ones warn if the probe ids agree, unless ``strict``)."""
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


# --- lock files ----------------------------------------------------------------------------


def write_lock(path: str, key: CacheKey) -> None:
    """Write a lock file recording ``key`` (atomically)."""
    write_json_atomic(path, {"shardcache_lock": LOCK_VERSION, "key": key.to_json()})


def read_lock(path: str) -> CacheKey:
    """The key a lock file records (SourceError: unreadable; ConfigError: not a lock file)."""
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
    """The key a manifest records (ConfigError when it has none)."""
    if not manifest.get("key"):
        raise ConfigError(f"{where}: the manifest has no cache key; rebuild the cache")
    return CacheKey.from_json(manifest["key"])


def raise_if_mismatch(comparison: KeyComparison, where: str) -> None:
    """Raise ``CacheKeyMismatch``, listing the changed fields, unless the keys are compatible."""
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


#: options mapping -> CacheKey; registered by the package facade (``shardcache/__init__.py``),
#: which may import the builder: the store and the readers never do (one-way layering).
_OPTIONS_RESOLVER: Callable[[Mapping[str, Any]], CacheKey] | None = None


def register_options_resolver(resolver: Callable[[Mapping[str, Any]], CacheKey]) -> None:
    """Set how ``expected_key`` turns a mapping of build options into a key."""
    global _OPTIONS_RESOLVER
    _OPTIONS_RESOLVER = resolver


def expected_key(expect: Any) -> CacheKey:
    """The key ``expect=`` names: a CacheKey, a lock file path or a mapping of build options."""
    if isinstance(expect, CacheKey):
        return expect
    if isinstance(expect, (str, os.PathLike)):
        return read_lock(os.fspath(expect))
    if isinstance(expect, Mapping):
        if _OPTIONS_RESOLVER is None:
            raise ConfigError(
                "expect: a mapping of tokenizer options needs the builder to compute its key "
                "(it loads the tokenizer); import shardcache first, or pass a CacheKey or a "
                "lock file path"
            )
        return _OPTIONS_RESOLVER(expect)
    raise ConfigError(
        f"expect: got {type(expect).__name__}; give a CacheKey, a lock file path or a mapping "
        "of tokenizer options"
    )


def verify_manifest_key(manifest: Mapping[str, Any], expect: Any, where: str) -> CacheKey:
    """Check a cache's recorded key against a reader's ``expect`` and return it.

    Components the expected key lacks (e.g. ``data``) are skipped.
    """
    recorded = manifest_key(manifest, where)
    wanted = expected_key(expect)
    skip = tuple(n for n in COMPONENTS if wanted.components.get(n) is None)
    raise_if_mismatch(compare(recorded, wanted, skip=skip), where)
    return recorded
