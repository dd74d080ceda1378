"""What the environment says of an ``s3://`` store: its endpoint, region and credentials
(environment keys, a profile of the shared credentials file), and whether any AWS
credentials are named at all.

Only an ``s3://`` path runs this. Pure functions over the environment (and the
credentials file, cached by its mtime and size): any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.location``.
"""

from __future__ import annotations

import configparser
import functools
import os
from typing import Any


def settings_from_env() -> dict[str, Any]:
    """S3-compatible servers: tensorstore's s3 driver ignores ``AWS_ENDPOINT_URL``
    (it always talks to amazonaws.com), so an ``s3://`` URL takes it from here.

    With both keys in the environment, the credentials are named as coming from it:
    the default chain would pick them first too (the same credentials), but builds its
    profile provider on the way, which logs about 5 ERROR lines per open when
    ``~/.aws/config`` or ``~/.aws/credentials`` is missing (aws-c-auth, through
    tensorstore's absl logging, on stderr). Else a profile with both keys in the shared
    credentials file (``AWS_PROFILE``, default ``default``) is named with its files
    (:func:`profile_with_keys`). Anything else is left to the default chain."""
    settings: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        settings["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        settings["aws_credentials"] = {"type": "environment"}
        return settings
    credentials = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser(
        "~/.aws/credentials"
    )
    config = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    profile = os.environ.get("AWS_PROFILE") or "default"
    try:
        info = os.stat(credentials)
    except OSError:
        return settings
    stamp = (info.st_mtime_ns, info.st_size)
    named = profile_with_keys(credentials, stamp, profile, config, os.path.isfile(config))
    if named is not None:
        settings["aws_credentials"] = named
    return settings


@functools.lru_cache(maxsize=8)
def profile_with_keys(
    credentials: str, stamp: tuple[int, int], profile: str, config: str, config_exists: bool
) -> dict[str, str] | None:
    """The profile provider, named in full, when the credentials file holds both keys of
    ``profile``: the keys the default chain should read next, but tensorstore 0.1.86's
    chain finds no profile ("could not load a profile at .") and goes on anonymous
    (access denied); named with its files it reads them, and logs nothing. A missing
    config file is given as the empty ``os.devnull``. None for any other file (a role,
    SSO, a process: left to the default chain). ``stamp``: the file's mtime and size, a
    cache key (the file is read again when it changes)."""
    del stamp
    parser = configparser.RawConfigParser()
    try:
        parser.read(credentials, encoding="utf-8")
        keys = parser.has_option(profile, "aws_access_key_id") and parser.has_option(
            profile, "aws_secret_access_key"
        )
    except (configparser.Error, OSError, UnicodeError):
        return None
    if not keys:
        return None
    return {
        "type": "profile",
        "profile": profile,
        "credentials_file": credentials,
        "config_file": config if config_exists else os.devnull,
    }


def aws_credentials_present() -> bool:
    """Whether the environment names any AWS credentials (keys, a profile, a
    credentials file): otherwise the default chain ends anonymous."""
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE"):
        return True
    if os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") or os.environ.get(
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"
    ):
        return True
    files = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser(
        "~/.aws/credentials"
    )
    return os.path.isfile(files)
