"""Plain text files, one document per file (``.txt``, ``.md``, source code through a glob).

The whole file is the text (UTF-8, a leading BOM dropped), so its record index is 0 and
``--text-field`` does not apply. Read when named or matched by a glob, never picked up from a
folder (a README beside a corpus is not data); a glob's match that no other format claims is
read as text, which is how a code corpus is given (``--input 'src/**/*.py'``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from shardcache.builder.inputs.base import (
    Batcher,
    InputFile,
    InputSlice,
    ReadHooks,
    TextBatch,
    WholeFiles,
    open_hashing,
)

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class TextFormat(WholeFiles):
    """Plain text files; each is one document."""

    name: str = "text"
    suffixes: tuple[str, ...] = (".txt", ".md", ".markdown", ".rst")
    position: str = "file"
    in_folders: bool = False
    hashes_while_reading: bool = True

    def read(
        self, file: InputFile, part: InputSlice, batcher: Batcher, text_field: str,
        hooks: ReadHooks,
    ) -> Iterator[TextBatch]:  # fmt: skip
        """See ``InputFormat.read``."""
        raw = open_hashing(file, hooks)
        with raw:
            data = b"".join(iter(lambda: raw.read(hooks.chunk_bytes), b""))
            if hooks.digest is not None:
                hooks.digest.bytes_read = raw.bytes_read
                hooks.digest.read_sha256 = hooks.digest.sha256 = raw.sha256.hexdigest()
        try:
            text = data.removeprefix(_BOM).decode("utf-8")
        except UnicodeDecodeError:
            batcher.bad(0, "invalid_utf8", data)
            return
        if batcher.kind == "chat":
            batcher.bad(0, "no_messages_field", "a plain text file holds no conversation")
            return
        yield from batcher.add_value(0, text, text_field)
        batch = batcher.flush()
        if batch is not None:
            yield batch

    def sample_fields(self, file: InputFile, records: int) -> dict[str, str]:
        """See ``InputFormat.sample_fields``."""
        return {}

    def folder_files(self, folder: str) -> list[str] | None:
        """See ``InputFormat.folder_files``."""
        return None


FORMATS = (TextFormat(),)
