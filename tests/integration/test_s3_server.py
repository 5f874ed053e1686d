"""The tests' S3 server (tests/_helpers/s3_server.py, SeaweedFS on 127.0.0.1) through s3fs,
fsspec's client for ``s3://`` paths: objects go in and come back, the keys reach child processes
through the environment, and requests are authenticated (a wrong secret and no keys at all are
refused)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

s3fs = pytest.importorskip("s3fs")


def _fs(endpoint_url: str, **keys: Any) -> Any:
    # skip_instance_cache: s3fs would hand back a cached instance of equal arguments.
    return s3fs.S3FileSystem(endpoint_url=endpoint_url, skip_instance_cache=True, **keys)


def test_write_list_read_delete(s3_env, s3_url):
    fs = _fs(s3_env.endpoint_url)  # the keys from the environment (AWS_ACCESS_KEY_ID, ...)
    fs.pipe(f"{s3_url}/a.txt", b"hello")
    with fs.open(f"{s3_url}/sub/b.bin", "wb") as f:
        f.write(b"\x00" * 1000)
    root = s3_url.removeprefix("s3://")
    assert sorted(fs.find(s3_url)) == [f"{root}/a.txt", f"{root}/sub/b.bin"]
    assert fs.cat(f"{s3_url}/a.txt") == b"hello"
    assert fs.size(f"{s3_url}/sub/b.bin") == 1000
    fs.rm(s3_url, recursive=True)
    assert not fs.exists(f"{s3_url}/a.txt") and not fs.exists(f"{s3_url}/sub/b.bin")
    # No object is left; SeaweedFS may still show the emptied prefix itself as a directory
    # (its directories outlive their last object for a while: see s3_server.py).
    assert fs.find(s3_url) in ([], [root])


def test_a_child_process_finds_the_keys_in_its_environment(s3_env, s3_url):
    code = (
        "import sys, s3fs; "
        "fs = s3fs.S3FileSystem(endpoint_url=sys.argv[1]); "
        "fs.pipe(sys.argv[2], b'from a child')"
    )
    subprocess.run(
        [sys.executable, "-c", code, s3_env.endpoint_url, f"{s3_url}/child.txt"],
        check=True,
        timeout=60,
    )
    assert _fs(s3_env.endpoint_url).cat(f"{s3_url}/child.txt") == b"from a child"


def test_requests_are_authenticated(s3_server, s3_url):
    good = _fs(s3_server.endpoint_url, key=s3_server.access_key, secret=s3_server.secret_key)
    good.pipe(f"{s3_url}/secret.txt", b"x")
    wrong = _fs(s3_server.endpoint_url, key=s3_server.access_key, secret="not-the-secret")
    with pytest.raises(PermissionError):
        wrong.cat(f"{s3_url}/secret.txt")
    with pytest.raises(PermissionError):
        wrong.pipe(f"{s3_url}/other.txt", b"y")
    anonymous = _fs(s3_server.endpoint_url, anon=True)
    with pytest.raises(PermissionError):
        anonymous.cat(f"{s3_url}/secret.txt")
    assert not good.exists(f"{s3_url}/other.txt")


def test_storage_options_hold_no_secret(s3_server):
    assert s3_server.storage_options() == {"endpoint_url": s3_server.endpoint_url}
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    assert s3_server.env()["AWS_DEFAULT_REGION"] == "us-east-1"
