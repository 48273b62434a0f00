"""Input formats: one module per format behind ``InputFormat``, and the registry of them.

The plan (which files are inputs, how they split), the partitions and the audit (how records
are read), the gate and the CLI help all ask this registry, never a format by name. A new
format is a module implementing ``InputFormat`` and its entry in ``READERS``.
"""

from __future__ import annotations

import os

from shardcache.builder.inputs import arrow, delimited, jsonl, parquet, text
from shardcache.builder.inputs.base import InputFormat
from shardcache.builder.inputs.jsonl import ARRAY_LAYOUT
from shardcache.errors import SourceError

#: Every input format, in the order the help lists them.
READERS: tuple[InputFormat, ...] = (
    *jsonl.FORMATS, *parquet.FORMATS, *arrow.FORMATS, *delimited.FORMATS, *text.FORMATS,
)  # fmt: skip
#: The format of a file a glob matched that no suffix claims: the glob named it as a document.
GLOB_FORMAT = text.FORMATS[0].name
FORMATS = tuple(r.name for r in READERS)
#: The formats a folder's files are read as; the others (plain text) only when named or globbed.
FOLDER_FORMATS = tuple(r.name for r in READERS if r.in_folders)
_BY_NAME = {r.name: r for r in READERS}
#: Longest suffix first: ``.jsonl.zst`` before ``.zst`` or ``.jsonl``.
_SUFFIXES = sorted(((s, r) for r in READERS for s in r.suffixes), key=lambda sr: -len(sr[0]))


def reader_of(name: str) -> InputFormat:
    """The format named ``name`` (an ``InputFile.format``).

    Raises:
        SourceError: no such format (a plan recorded by another version).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise SourceError(
            f"input format {name!r} is unknown; known: {', '.join(FORMATS)}. A plan recorded by "
            "another shardcache version: rebuild with --force"
        ) from None


def detect_format(path: str, in_folder: bool = False) -> str | None:
    """The input format a file name implies; None for files that are not inputs.

    ``in_folder``: the file was found walking a folder (formats read only when named or
    globbed, such as plain text, do not count).
    """
    name = os.path.basename(path).lower()
    for suffix, reader in _SUFFIXES:
        if name.endswith(suffix):
            return reader.name if reader.in_folders or not in_folder else None
    return None


def named_only(path: str) -> bool:
    """Whether a file is of a format read only when named or globbed (plain text)."""
    return detect_format(path) is not None and detect_format(path, in_folder=True) is None


def no_folder_input(spec: str, skipped: list[str], what: str = "folder") -> str:
    """The message for a folder (or URL prefix) holding no input file.

    ``skipped``: its files of a format read only when named or globbed; the message says so and
    gives the glob that reads them (their most common suffix, in every subfolder).
    """
    read = f"a {what}'s files are read as {', '.join(FOLDER_FORMATS)}"
    named = [r for r in READERS if not r.in_folders]
    kinds = "; ".join(f"{r.name} ({', '.join(r.suffixes)})" for r in named)
    if not skipped:
        example = f"{spec.rstrip('/')}/**/*{named[0].suffixes[0]}" if named else spec
        return (
            f"input {spec!r}: the {what} holds no input file ({read}; {kinds} only when named "
            f"or matched by a glob, e.g. -i '{example}')"
        )
    suffix = max(
        {os.path.splitext(s)[1] for s in skipped},
        key=lambda x: sum(s.endswith(x) for s in skipped),
    )
    shown = ", ".join(os.path.basename(s) for s in sorted(skipped)[:3])
    more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    return (
        f"input {spec!r}: the {what} holds no input file ({read}), but {len(skipped)} file(s) "
        f"read only when named or matched by a glob ({shown}{more}): plain text is never picked "
        f"up from a {what} (a README beside a corpus is not data); give them by glob, "
        f"-i '{spec.rstrip('/')}/**/*{suffix}', or by name"
    )


def folder_files(folder: str) -> list[str] | None:
    """The input files of a folder a format owns as a whole (None: list its files)."""
    for reader in READERS:
        files = reader.folder_files(folder)
        if files is not None:
            return files
    return None


def formats_help() -> str:
    """The formats and their suffixes, for the CLI's help."""
    return "; ".join(f"{r.name} ({', '.join(r.suffixes)})" for r in READERS)


def suffixes() -> list[str]:
    """Every suffix an input may have, sorted."""
    return sorted(s for s, _ in _SUFFIXES)


def position_name(fmt: str) -> str:
    """What a record index counts in a format (or ``ARRAY_LAYOUT``): ``"line"``, ``"row"``..."""
    if fmt == ARRAY_LAYOUT:
        return "item"
    reader = _BY_NAME.get(fmt)
    return reader.position if reader is not None else "line"


def record_position(fmt: str, index: int) -> str:
    """A record's human, 1-based position: ``"line 4"``, ``"row 4"`` or ``"item 4"``."""
    return f"{position_name(fmt)} {index + 1}"


def position_fields(fmt: str, index: int) -> dict[str, int]:
    """The 1-based position stored next to the 0-based ``record`` in quarantine entries."""
    return {position_name(fmt): index + 1}
