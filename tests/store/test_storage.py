"""The build's storage interface: a local folder and an fsspec URL behave alike."""

from __future__ import annotations

import os

import pytest

from shardcache.errors import BuildLockedError, CacheError
from shardcache.store.storage import FsspecStorage, LocalStorage, open_storage


@pytest.fixture(params=["local", "url"])
def storage(request, tmp_path):
    folder = tmp_path / "out"
    return open_storage(str(folder) if request.param == "local" else f"file://{folder}")


def test_open_storage_picks_the_implementation(tmp_path):
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}"), FsspecStorage)
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match="not a folder"):
        open_storage(str(tmp_path / "file"))


def test_write_read_list_remove(storage):
    assert storage.read_json("parts/build.json") is None
    assert not storage.exists("parts/build.json")
    storage.write_json("parts/build.json", {"b": 1, "a": [1, 2]})
    storage.write_json("parts/p00000.json", {"x": 1}, private=True)
    assert storage.exists("parts/build.json")
    assert storage.read_json("parts/build.json") == {"a": [1, 2], "b": 1}
    got = storage.read_many(["parts/build.json", "parts/missing.json"])
    assert got["parts/build.json"] == b'{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}\n'
    assert got["parts/missing.json"] is None
    assert storage.sizes("parts") == {"build.json": len(got["parts/build.json"]),
                                      "p00000.json": len(b'{\n "x": 1\n}\n')}  # fmt: skip
    assert storage.sizes("nothing") == {}
    storage.remove(["parts/p00000.json", "parts/missing.json"])
    assert set(storage.sizes("parts")) == {"build.json"}
    storage.remove_folders(["parts", "nothing"])
    assert storage.sizes("parts") == {}


def test_staged_files_are_published_in_order_and_fetched_back(storage, tmp_path):
    names = ["shards/p00000-b00-00000.arrow", "parts/p00000.json"]
    with storage.staging("test") as staged:
        for i, name in enumerate(names):
            with open(os.path.join(staged, name), "wb") as f:
                f.write(bytes([i]) * 5)
        storage.publish(staged, names)
    assert storage.sizes("shards") == {"p00000-b00-00000.arrow": 5}
    with storage.staging("again") as staged:
        storage.fetch(staged, names)
        with open(os.path.join(staged, names[1]), "rb") as f:
            assert f.read() == b"\x01" * 5


def test_only_a_local_folder_is_locked(tmp_path):
    local = open_storage(str(tmp_path / "out"))
    with local.lock(), pytest.raises(BuildLockedError):
        open_storage(str(tmp_path / "out")).lock().__enter__()
    url = open_storage(f"file://{tmp_path / 'url'}")
    with url.lock(), url.lock():  # object stores have no lock: nothing is held
        pass


def test_a_listed_name_cannot_leave_the_url_output(tmp_path):
    storage = open_storage(f"file://{tmp_path / 'out'}")
    with pytest.raises(CacheError):
        storage.read_json("parts/../../secret.json")
