"""Issue 13 item 11: an unreachable object store is a clear error (fast tier: nothing listens,
so no server is started)."""

from __future__ import annotations

import re

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


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize(
    ("output", "says"),
    [
        ("s3://corpus/q?x=1#f", r"s3://corpus/q\?x=1#f.*no query or fragment"),
        ("s3://nobucket/x", r"s3://nobucket/x.*bucket 'nobucket' does not exist"),
    ],
)
def test_an_output_url_the_store_cannot_hold_is_a_clear_error(
    s3, corpus, tokenizer_dir, output, says
):
    # issue 51 item 4: a URL with a query or fragment, and a bucket that does not exist, were
    # raw tracebacks (FileNotFoundError; botocore's NoSuchBucket)
    from click.testing import CliRunner

    from shardcache.cli import main

    folder, _ = corpus("jsonl", n_files=1, docs=10)
    result = CliRunner().invoke(main, ["build", "-i", folder, "-t", tokenizer_dir, "-o", output])
    assert result.exit_code in (1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    assert re.search(says, result.output, re.S), result.output
