"""What transformers resolves from a tokenizer folder, as plain JSON, remembered on disk.

``ResolvedTokenizer`` holds all a text build, ``check`` and ``lock`` take from transformers; the
key and probe read only it, so a key is the same from transformers or from the memo. The memo's
digest covers the folder's files (not weights), the resolver packages' versions and
``RESOLVED_MEMO_VERSION``; a memo is used only when what decides ids agrees with the folder's
files. ``SHARDCACHE_NO_MEMO=1`` bypasses it; chat builds and audits never use it.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, fields
from importlib import metadata
from typing import Any

from shardcache.store.files import memo_disabled, read_memo, sha256_file, sha256_text, write_memo
from shardcache.store.key import canonical_json

#: Folder under ``$SHARDCACHE_CACHE_DIR`` of resolved tokenizers.
RESOLVED_DIR = "tokenizers"

#: Bump when ``ResolvedTokenizer`` or what goes into a field changes.
RESOLVED_MEMO_VERSION = 1

#: File endings of model weights: a tokenizer never reads them, so they are not hashed.
NOT_TOKENIZER_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5",
                       ".msgpack", ".onnx")  # fmt: skip

#: The named special tokens of a transformers tokenizer (the key's ``special_tokens``).
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")  # fmt: skip


#: Packages whose versions can change what transformers resolves from the same files
#: (with the converters used when a folder has no tokenizer.json).
RESOLVER_PACKAGES = ("transformers", "tokenizers", "sentencepiece", "protobuf", "tiktoken")


def library_versions(names: tuple[str, ...] = ("transformers", "tokenizers")) -> dict[str, str]:
    """Installed versions of packages by name (``"unknown"`` when missing)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


@dataclass(frozen=True)
class ResolvedTokenizer:
    """What a text build takes from a transformers tokenizer, as plain JSON-able values.

    ``backend`` is ``backend_tokenizer.to_str()``, with ``truncation`` and ``padding`` its saved
    settings as loaded; ``named_special`` maps names of ``SPECIAL_NAMES`` to ``[token, id]``;
    ``additional_special`` is sorted, ``all_special`` in transformers' order.
    """

    class_name: str
    backend: str
    truncation: dict[str, Any] | None
    padding: dict[str, Any] | None
    max_token_id: int
    eos_token_id: int | None
    sep_token_id: int | None
    pad_token_id: int | None
    named_special: dict[str, list[Any]]
    additional_special: list[str]
    all_special: list[str]

    @classmethod
    def from_hf(cls, hf: Any, backend: str, truncation: Any, padding: Any,
                max_token_id: int) -> ResolvedTokenizer:  # fmt: skip
        """The record of transformers tokenizer ``hf``, its backend JSON and saved settings."""
        named = {}
        for name in SPECIAL_NAMES:
            token = getattr(hf, name, None)
            if token is not None:
                named[name] = [str(token), hf.convert_tokens_to_ids(str(token))]
        return cls(
            class_name=type(hf).__name__,
            backend=backend,
            truncation=truncation,
            padding=padding,
            max_token_id=int(max_token_id),
            eos_token_id=_int_or_none(getattr(hf, "eos_token_id", None)),
            sep_token_id=_int_or_none(getattr(hf, "sep_token_id", None)),
            pad_token_id=_int_or_none(getattr(hf, "pad_token_id", None)),
            named_special=named,
            additional_special=sorted(
                str(t) for t in (getattr(hf, "additional_special_tokens", None) or [])
            ),
            all_special=[str(t) for t in getattr(hf, "all_special_tokens", []) or []],
        )

    def to_json(self) -> dict[str, Any]:
        """The record as JSON, fields by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, value: Any) -> ResolvedTokenizer:
        """The record ``to_json`` saved; ``ValueError`` naming a field of the wrong shape."""
        if not isinstance(value, dict) or set(value) != {f.name for f in fields(cls)}:
            raise ValueError("not a resolved tokenizer record (other fields)")
        checks = {
            "class_name": lambda v: isinstance(v, str),
            "backend": lambda v: isinstance(v, str),
            "truncation": lambda v: v is None or isinstance(v, dict),
            "padding": lambda v: v is None or isinstance(v, dict),
            "max_token_id": _is_int,
            "eos_token_id": lambda v: v is None or _is_int(v),
            "sep_token_id": lambda v: v is None or _is_int(v),
            "pad_token_id": lambda v: v is None or _is_int(v),
            "named_special": _is_named_special,
            "additional_special": _is_str_list,
            "all_special": _is_str_list,
        }
        for name, ok in checks.items():
            if not ok(value[name]):
                raise ValueError(f"resolved tokenizer record: field {name!r} has the wrong type")
        return cls(**value)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_named_special(value: Any) -> bool:
    return isinstance(value, dict) and all(
        name in SPECIAL_NAMES and isinstance(pair, list) and len(pair) == 2
        and isinstance(pair[0], str)
        for name, pair in value.items()
    )  # fmt: skip


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def folder_digest(folder: str) -> str | None:
    """The memo digest of a folder's files and resolver versions (None: a file is unreadable)."""
    try:
        entries = sorted(
            (e.name, e.path)
            for e in os.scandir(folder)
            if e.is_file() and not e.name.endswith(NOT_TOKENIZER_FILES)
        )
        files = [[name, sha256_file(path)] for name, path in entries]
    except OSError:
        return None
    head = [RESOLVED_MEMO_VERSION, library_versions(RESOLVER_PACKAGES), files]
    return sha256_text(canonical_json(head))


def parse_tokenizer_json(text: str) -> Any:
    """``json.loads(text)`` with the cyclic garbage collector paused.

    A tokenizer's JSON holds hundreds of thousands of containers, none in a cycle; collections
    their allocation would trigger traverse everything alive to free nothing.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return json.loads(text)
    finally:
        if enabled:
            gc.enable()


def tokenizer_json_text(folder: str) -> str | None:
    """The text of a folder's tokenizer.json, or None when absent, unreadable or not UTF-8."""
    try:
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError):  # absent, unreadable or not UTF-8
        return None


def read_resolved(folder: str, saved: str | None = None) -> ResolvedTokenizer | None:
    """The memoised record of ``folder``, checked against ``saved`` or the file; None: a miss."""
    if memo_disabled():  # not even the digest
        return None
    digest = folder_digest(folder)
    if digest is None:
        return None
    value = read_memo(RESOLVED_DIR, digest)
    if value is None:
        return None
    try:
        resolved = ResolvedTokenizer.from_json(value)
    except (ValueError, TypeError):
        return None
    return resolved if agrees_with_files(resolved, folder, saved) else None


#: The parts of a tokenizer.json that decide which ids a text gets.
PIPELINE_PARTS = ("model", "normalizer", "pre_tokenizer", "post_processor", "decoder",
                  "added_tokens")  # fmt: skip

#: The files of a folder that declare its named special tokens, in the order consulted.
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def agrees_with_files(resolved: ResolvedTokenizer, folder: str, text: str | None = None) -> bool:
    """Whether every id-deciding part of ``resolved`` agrees with ``folder``'s files."""
    text = text if text is not None else tokenizer_json_text(folder)
    if text is None:
        return False
    try:
        saved = parse_tokenizer_json(text)
        backend = parse_tokenizer_json(resolved.backend)
    except (ValueError, RecursionError):
        return False
    if not isinstance(saved, dict) or not isinstance(backend, dict):
        return False
    if any(backend.get(part) != saved.get(part) for part in PIPELINE_PARTS):
        return False
    ids = _token_ids(backend)
    if ids is None or resolved.max_token_id != max(ids.values(), default=0):
        return False
    for token, token_id in resolved.named_special.values():
        if ids.get(token) != token_id:
            return False
    named = {name: pair[1] for name, pair in resolved.named_special.items()}
    for name, value in (("eos_token", resolved.eos_token_id), ("sep_token",
                        resolved.sep_token_id), ("pad_token", resolved.pad_token_id)):  # fmt: skip
        if named.get(name) != value:
            return False
    declared = _declared_special(folder)
    if declared is None:
        return False
    return all(
        resolved.named_special.get(name, [None])[0] == token for name, token in declared.items()
    )


def _token_ids(backend: dict[str, Any]) -> dict[str, int] | None:
    """Token -> id of a parsed backend (vocabulary and added tokens); None for other layouts."""
    model = backend.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") in ("BPE", "WordPiece", "WordLevel") and isinstance(vocab, dict):
        ids = dict(vocab)
    elif model.get("type") == "Unigram" and isinstance(vocab, list):
        ids = {piece[0]: k for k, piece in enumerate(vocab) if isinstance(piece, list) and piece}
    else:
        return None
    for added in backend.get("added_tokens") or []:
        if isinstance(added, dict) and "content" in added:
            ids[added["content"]] = added.get("id")
    return ids


def _declared_special(folder: str) -> dict[str, str] | None:
    """The named special tokens ``folder`` declares (first file wins); None if one is unreadable."""
    declared: dict[str, str] = {}
    for name in reversed(SPECIAL_TOKEN_FILES):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(config, dict):
            return None
        for special in SPECIAL_NAMES:
            value = config.get(special)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                declared[special] = value
    return declared


def write_resolved(digest: str | None, resolved: ResolvedTokenizer) -> None:
    """Remember a record under ``digest`` (taken before transformers read the folder)."""
    if digest is not None:
        write_memo(RESOLVED_DIR, digest, resolved.to_json())
