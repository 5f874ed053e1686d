"""Object-store URLs for ``checkpoint_dir``: which are taken, which backend (and extra) each
needs, and the ``storage_options`` that may travel with a job. Pure: fsspec is asked only
whether a backend is installed.

A URL is never turned into a local path: ``s3://b/run`` is read and written through fsspec's
backend for ``s3`` (s3fs). Credentials never travel with the job: each host's backend finds its
own (environment, instance profile, service account), so ``storage_options`` takes settings
that are not secret (an endpoint URL, a region, a profile name) and refuses the rest by name.

Non-goals: reading or writing (``_checkpoint.storage``); ``file://`` and ``dbfs:/``, which are
paths (``checks.checkpoint_directory``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from sparkdist._core.errors import ConfigError, ConfigTypeError

#: A URL's scheme (two characters at least: "C:/x" is a Windows drive, not a scheme) and the
#: slash after its colon ("s3://b/k", "gs://", "abfss://", "file:///x", Databricks' "dbfs:/x").
URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/")

#: The extra of sparkdist that installs each well-kept backend.
EXTRA_OF_SCHEME = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "abfs": "azure",
    "abfss": "azure",
    "az": "azure",
    "adl": "azure",
}
#: Schemes fsspec knows that cannot hold a run's checkpoints: every process would see its own
#: (memory), or they cannot be written (http, zip, ...).
NOT_SHARED = {
    "memory": "it lives inside one process: every rank would see its own",
    "http": "it cannot be written",
    "https": "it cannot be written",
    "zip": "it cannot be written",
    "tar": "it cannot be written",
    "github": "it cannot be written",
}
#: Option names that hold (or point at) secrets: refused, whatever their case.
_SECRET = re.compile(
    r"(secret|token|passw|credential|sas|account_key|connection_string|private|^key$|^anon_key$)",
    re.IGNORECASE,
)
_OPTION_VALUE = (str, int, float, bool, type(None))


def scheme_of(where: str) -> str | None:
    """The URL's scheme in lower case, or None for a path."""
    match = URL.match(where)
    return match.group("scheme").lower() if match else None


def check_backend(url: str, scheme: str) -> None:
    """Refuse a scheme fsspec does not know, one that cannot hold checkpoints, or one whose
    backend is not installed here, naming the extra to install."""
    if scheme in NOT_SHARED:
        raise ConfigError(
            f"checkpoint_dir={url!r}: {scheme}:// cannot hold a run's checkpoints "
            f"({NOT_SHARED[scheme]}); pass a directory every host mounts or an object-store URL "
            "(s3://, gs://, abfss://)"
        )
    from fsspec.registry import get_filesystem_class, known_implementations

    extra = EXTRA_OF_SCHEME.get(scheme)
    if scheme not in known_implementations and extra is None:
        raise ConfigError(
            f"checkpoint_dir={url!r}: fsspec knows no storage for {scheme}://; pass a "
            "directory every host mounts or a URL of s3://, gs://, abfss:// (or another "
            "scheme fsspec knows)"
        )
    try:
        get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        install = f"pip install 'sparkdist[{extra}]'" if extra else f"install its backend ({exc})"
        raise ConfigError(
            f"checkpoint_dir={url!r} needs fsspec's backend for {scheme}://, which is not "
            f"installed here: {install} on the driver and every executor"
        ) from None


def check_storage_options(value: Any) -> dict[str, Any]:
    """``storage_options`` as a plain dict of non-secret settings, or a clear refusal.

    Values are strings, numbers, booleans, None or mappings of those (they travel to the
    ranks as JSON). A key that names a secret is refused, with where the secret belongs; the
    secret's value never appears in the message.
    """
    if not isinstance(value, Mapping):
        raise ConfigTypeError(
            f"storage_options must be a mapping of settings such as "
            f'{{"endpoint_url": "https://...", "region_name": "eu-west-1"}}, got '
            f"{type(value).__name__}"
        )
    return _checked_mapping(value, "storage_options")


def _checked_mapping(value: Mapping[Any, Any], where: str) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ConfigTypeError(f"{where} keys must be str, got {type(key).__name__}")
        name = f"{where}[{key!r}]"
        if _SECRET.search(key):
            raise ConfigError(
                f"{name} looks like a credential, and credentials never travel with the job: "
                "give every host its own (environment variables such as AWS_ACCESS_KEY_ID, an "
                "instance profile, a service account, a profile name in profile=...), and "
                "pass only settings that are not secret (endpoint_url, region_name, ...)"
            )
        if isinstance(item, Mapping):
            checked[key] = _checked_mapping(item, name)
        elif isinstance(item, _OPTION_VALUE):
            checked[key] = item
        else:
            raise ConfigTypeError(
                f"{name} must be a str, number, bool, None or a mapping of those (it travels "
                f"to the ranks as JSON), got {type(item).__name__}"
            )
    return checked


def encode_options(options: Mapping[str, Any]) -> str:
    """The options as the ranks' environment carries them."""
    return json.dumps(dict(options), sort_keys=True)


def decode_options(text: str | None) -> dict[str, Any]:
    """The options a rank's environment carries (none when unset)."""
    if not text:
        return {}
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("the storage options in the environment are not a JSON object")
    return value
