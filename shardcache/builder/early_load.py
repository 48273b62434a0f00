"""Loading the fast backend from a folder's tokenizer.json before the tokenizer is resolved.

``load_fast_early`` starts the load; ``adopt_early`` keeps it only when the file encodes as
transformers' JSON does (``ids_content``), ``adopt_agreed`` when the caller has checked that.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardcache.builder.ahead import Ahead
from shardcache.builder.backends import FastBackend
from shardcache.builder.fast_loaders import import_fast_module
from shardcache.builder.tokenizer_memo import parse_tokenizer_json
from shardcache.errors import EncoderError, MissingDependencyError

#: Keys of a tokenizer.json that never change the ids an encode returns: the decoder (ids ->
#: text only) and the saved truncation / padding (every backend switches both off).
IDS_IRRELEVANT_KEYS = ("decoder", "truncation", "padding")


def ids_content(backend_json: Mapping[str, Any]) -> dict[str, Any]:
    """A tokenizer's JSON without what cannot change ids: equal contents encode texts alike.

    Drops ``IDS_IRRELEVANT_KEYS`` and ByteLevel ``trim_offsets``. transformers rewrites parts of
    tokenizer.json as it loads it; this lets a backend loaded from the file stand in for one
    loaded from transformers' JSON.
    """

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: strip(v)
                for k, v in value.items()
                if not (k == "trim_offsets" and value.get("type") == "ByteLevel")
            }
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    content = {k: v for k, v in backend_json.items() if k not in IDS_IRRELEVANT_KEYS}
    for key in ("pre_tokenizer", "post_processor"):
        if key in content:
            content[key] = strip(content[key])
    return content


@dataclass
class EarlyLoad:
    """A fast backend loaded from a folder's tokenizer.json before the tokenizer was resolved."""

    text: str | None
    backend: FastBackend | None = None
    error: EncoderError | MissingDependencyError | None = None

    def take(self) -> FastBackend:
        """The backend, freeing the text; re-raises the load's refusal (the same object)."""
        self.text = None
        if self.error is not None:
            raise self.error
        return self.backend  # type: ignore[return-value]


def _load_early(path: str, text: str | None, entered: threading.Event) -> EarlyLoad:
    entered.set()
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    early = EarlyLoad(text)
    try:
        early.backend = FastBackend(text)
    except (EncoderError, MissingDependencyError) as err:
        early.error = err
    return early


def load_fast_early(folder: str, text: str | None = None) -> Ahead[EarlyLoad] | None:
    """Start loading the fast backend from ``folder/tokenizer.json`` (None: the folder has none).

    ``text`` is the file's content when the caller has read it. ``adopt_early`` or
    ``adopt_agreed`` decides whether the backend is used.
    """
    path = os.path.join(folder, "tokenizer.json")
    if text is None and not os.path.isfile(path):
        return None
    with contextlib.suppress(MissingDependencyError):  # the thread reports it
        import_fast_module()
    entered = threading.Event()
    ahead = Ahead(_load_early, path, text, entered)
    entered.wait(timeout=1.0)  # running before the caller takes the GIL for long
    return ahead


def _adopt(early: Ahead[EarlyLoad], backend_json: Mapping[str, Any], serialized: str) -> Any:
    try:
        loaded = early.result()
    except (OSError, ValueError):  # file unreadable: load transformers' JSON
        return FastBackend(serialized)
    text, loaded.text = loaded.text, None  # the file (large for a big vocabulary) goes now
    try:
        same = ids_content(parse_tokenizer_json(text or "")) == ids_content(backend_json)
    except (ValueError, RecursionError):  # not JSON: load transformers' JSON
        same = False
    if not same:
        loaded.backend = None
        return FastBackend(serialized)
    return loaded.take()


def adopt_early(
    early: Ahead[EarlyLoad], backend_json: Mapping[str, Any], serialized: str
) -> Ahead[FastBackend]:
    """The build's fast backend from an early load, decided in the background.

    The early backend is kept only when its file has the same ``ids_content`` as
    ``backend_json`` (transformers' JSON); otherwise a new one loads from ``serialized``.
    """
    return Ahead(_adopt, early, backend_json, serialized)


def adopt_agreed(early: Ahead[EarlyLoad]) -> Ahead[FastBackend]:
    """The early backend as it is, waited for in the background (a refusal re-raised by ``result``).

    Only for a caller that has checked that the loaded text agrees, in every part that decides
    ids, with the build's tokenizer (``tokenizer_memo.read_resolved`` does, for the memo).
    """
    return Ahead(_take, early)


def _take(early: Ahead[EarlyLoad]) -> FastBackend:
    return early.result().take()
