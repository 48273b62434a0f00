"""Issue 13 item 11: an unreachable object store is a clear error (fast tier: nothing listens,
so no server is started)."""

from __future__ import annotations

import pytest

from conftest import free_port


def test_an_unreachable_endpoint_is_a_clear_error(monkeypatch, tmp_path):
    # issue 13 item 11: no botocore traceback; the URL, the endpoint and what to check
    pytest.importorskip("s3fs")
    import s3fs

    from shardcache import CacheError, open_cache

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
        "AWS_MAX_ATTEMPTS": "1", "SHARDCACHE_CACHE_DIR": str(tmp_path / "local-cache"),
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(CacheError, match=r"s3://corpus/cache.*cannot reach.*endpoint"):
            open_cache("s3://corpus/cache")
        from shardcache.store.verify import verify_cache

        with pytest.raises(CacheError, match=r"cannot reach"):
            verify_cache("s3://corpus/cache")  # not reported as a corrupt manifest
        from shardcache.builder.run import build
        from shardcache.config import build_options_from_mapping

        values = {
            "input": "s3://corpus/data",
            "tokenizer": str(tmp_path),
            "output": "s3://corpus/out",
        }
        with pytest.raises(CacheError, match=r"s3://corpus/out.*cannot reach"):
            build(build_options_from_mapping(values))
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
