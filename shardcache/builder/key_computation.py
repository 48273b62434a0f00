"""The cache key of a build configuration: components computed from the tokenizer itself.

The key's structure and comparison are the store's (``shardcache.store.key``); computing one
needs the tokenizer (the behaviour probe), so it lives here. Everything taken from transformers
is read off the encoder's ``ResolvedTokenizer``, so a key is byte-identical whether
transformers or its memo resolved the folder.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardcache.builder.encoders import make_encoder
from shardcache.builder.sources import list_inputs
from shardcache.builder.tokenizer_memo import library_versions
from shardcache.config import chat_options_from_mapping, tokenize_options_from_mapping
from shardcache.store.files import read_memo, sha256_file, sha256_text, write_memo
from shardcache.store.key import (
    CacheKey,
    canonical_json,
    inline_value,
)
from shardcache.store.layout import FORMAT_VERSION

#: Fixed probe texts; changing them changes every key (bump KEY_VERSION if you do).
PROBES: dict[str, str] = {
    "ascii": "The quick brown fox jumps over the lazy dog. 0123456789 !?#$%&*()[]{}",
    "cjk": "東京は日本の首都です。数据处理和机器学习。한국어 텍스트",
    "emoji": "🙂👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    "combining": "e\u0301 n\u0303 A\u030a Ω\u0308 क्षि ﬁ Ⅻ",
    "whitespace": "a  b   c\t\td\n\ne \u00a0f\u2003g   \n\t ",
    "code": "def f(x):\n    return {'k': [x ** 2, x // 3]}  # comment\n\tif a != b: pass",
}


def tokenizer_component(backend_json: Mapping[str, Any], truncation: Any, padding: Any) -> dict:
    """The key's tokenizer component: parsed tokenizer.json's content, large parts as digests.

    ``truncation`` and ``padding`` are the backend's saved settings as they were when loaded.
    """
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
        "normalizer": inline_value(backend_json.get("normalizer")),
        "pre_tokenizer": inline_value(backend_json.get("pre_tokenizer")),
        "model": {
            "type": model.get("type"),
            "vocab_size": len(vocab) if vocab is not None else None,
            "merges": len(model.get("merges") or []),
            "sha256": sha256_text(canonical_json(model)),
            "options": inline_value(
                {k: v for k, v in model.items() if k not in ("vocab", "merges")}
            ),
        },
        "post_processor": inline_value(backend_json.get("post_processor")),
        "decoder": inline_value(backend_json.get("decoder")),
        "added_tokens": inline_value(added),
        "truncation": truncation,
        "padding": padding,
    }


def probe_set(encoder: Any) -> dict[str, str]:
    """The probe texts by name: ``PROBES``, the special tokens as text, and a chat rendering."""
    specials = getattr(encoder, "text", encoder).resolved.all_special
    probes = dict(PROBES)
    if specials:
        probes["special_tokens"] = " ".join(specials) + " x" + "".join(specials)
    if hasattr(encoder, "probe_chat"):
        probes["chat"] = encoder.probe_chat()
    return probes


def probe_texts(encoder: Any) -> list[str]:
    """The probe texts in name order (the encoder gate encodes them too)."""
    probes = probe_set(encoder)
    return [probes[n] for n in sorted(probes)]


def data_component_from_files(files: list[Mapping[str, Any]]) -> dict:
    """The data component of a corpus named by its files.

    Keyed by relative path, so a key diff names the file edited, added or removed.
    """
    return {
        "mode": "files",
        "files": {f["relpath"]: {"size": f["size"], "sha256": f["sha256"]} for f in files},
    }


def data_component_from_version(version: str) -> dict:
    """The data component of a corpus named by its ``--data-version`` instead of its files."""
    return {"mode": "version", "version": str(version)}


#: Folder under ``$SHARDCACHE_CACHE_DIR`` of memoised tokenizer components.
COMPONENTS_DIR = "components"

#: Bump when ``tokenizer_component`` changes what it returns for the same input.
COMPONENT_MEMO_VERSION = 1


def memoised_tokenizer_component(
    serialized: str,
    backend_json: Callable[[], Mapping[str, Any]],
    truncation: Any,
    padding: Any,
) -> dict:
    """``tokenizer_component``, remembered by the sha256 of its whole input.

    ``backend_json`` is called only when the memo misses; any memo problem only means computing
    the component again.
    """
    head = canonical_json([COMPONENT_MEMO_VERSION, truncation, padding])
    digest = sha256_text(head + "\n" + serialized)
    saved = read_memo(COMPONENTS_DIR, digest)
    if isinstance(saved, dict):
        return saved
    value = tokenizer_component(backend_json(), truncation, padding)
    write_memo(COMPONENTS_DIR, digest, value)
    return value


def text_component(text: Any) -> dict:
    """The tokenizer component of a text encoder (memoised)."""
    return memoised_tokenizer_component(
        text.serialized, lambda: text.backend_json, text.backend_truncation, text.backend_padding
    )


def precompute_tokenizer_component(encoder: Any, use_memo: bool = True) -> None:
    """Compute the key's tokenizer component now and keep it on the encoder for ``compute_key``."""
    text = getattr(encoder, "text", encoder)
    if use_memo:
        text.tokenizer_component = text_component(text)
    else:
        text.tokenizer_component = tokenizer_component(
            text.backend_json, text.backend_truncation, text.backend_padding
        )


def compute_key(encoder: Any, data: Mapping[str, Any] | None) -> CacheKey:
    """The cache key of an encoder's configuration; ``data`` None: unknown, then not compared."""
    text = getattr(encoder, "text", encoder)  # a ChatEncoder wraps a TextEncoder
    resolved = text.resolved  # what transformers resolved (or its memo): never ``text.hf``
    options = text.options
    probes = probe_set(encoder)
    names = sorted(probes)
    # the reference (HF) encodes the probe: the key never depends on the backend
    ids = text.encode_reference([probes[n] for n in names])
    side = encoder.options.truncation_side if "chat" in probes else "right"
    truncation: dict[str, Any] = {
        "max_length": options.max_length,
        "strategy": options.truncation,
        "side": side,
    }
    if getattr(encoder.options, "preference", False):  # pairs: the prompt has its own limit
        truncation["side"] = "prompt from the left, completions from the right"
        truncation["max_prompt_length"] = encoder.options.max_prompt_length
    component = getattr(text, "tokenizer_component", None)
    versions = library_versions()  # package metadata: transformers is not imported
    return CacheKey(
        {
            "tokenizer": component if component is not None else text_component(text),
            "special_tokens": {
                "named": {name: list(pair) for name, pair in resolved.named_special.items()},
                "additional": inline_value(list(resolved.additional_special)),
                "end_id": text.eos_id,
                "pad_id": text.pad_id,
            },
            "behaviour": {
                "probes_sha256": sha256_text(canonical_json(probes)),
                "ids": {n: inline_value(list(map(int, i))) for n, i in zip(names, ids)},
            },
            "template": encoder.template_component(),
            "truncation": truncation,
            "data": dict(data) if data is not None else None,
            "versions": {
                "transformers": versions["transformers"],
                "tokenizers": versions["tokenizers"],
                "format_version": FORMAT_VERSION,
                "tokenizer_class": resolved.class_name,
            },
        }
    )


@dataclass
class DataHashing:
    """What hashing the data component cost: files, bytes and wall-clock seconds."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def mb_per_second(self) -> float:
        """Hashing throughput in MB/s (0 before any time is spent)."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def current_data(values: Mapping[str, Any], hashing: DataHashing) -> dict[str, Any] | None:
    """The data component from ``data_version`` or the ``input`` files; None if neither is set.

    Hashing the files adds to ``hashing``'s counters.
    """
    if values.get("data_version") is not None:
        return data_component_from_version(values["data_version"])
    inputs = values.get("input")
    if not inputs:
        return None
    exclude = values.get("exclude") or ()
    files = list_inputs(
        [inputs] if isinstance(inputs, str) else list(inputs),
        exclude_globs=(exclude,) if isinstance(exclude, str) else tuple(exclude),
    )
    start = time.perf_counter()
    entries = [{"relpath": f.relpath, "size": f.size, "sha256": sha256_file(f.path)} for f in files]
    hashing.files += len(files)
    hashing.bytes += sum(f.size for f in files)
    hashing.seconds += time.perf_counter() - start
    return data_component_from_files(entries)


def current_key(values: Mapping[str, Any], hashing: DataHashing) -> CacheKey:
    """The key the current recipe and flag values would build (no memo is read)."""
    encoder = make_encoder(
        tokenize_options_from_mapping(values), chat_options_from_mapping(values), audit=True
    )
    precompute_tokenizer_component(encoder, use_memo=False)  # an audit: no memo at all
    return compute_key(encoder, current_data(values, hashing))
