"""What the environment says of an ``s3://`` store: its endpoint, region and
credentials, and whether any AWS credentials are named at all. Pure functions over the
environment (and the credentials file, cached by its mtime and size): any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.location``.
"""

from __future__ import annotations

import configparser
import functools
import os
from typing import Any


def settings_from_env() -> dict[str, Any]:
    """The s3 driver's settings from the environment: the endpoint
    (``AWS_ENDPOINT_URL``, which tensorstore ignores), the region, and credentials named
    where the default chain would misbehave: keys in the environment (its profile
    provider logs ERROR lines per open without ``~/.aws`` files), else a profile with
    both keys in the credentials file (:func:`profile_with_keys`)."""
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
    """The profile provider, named with its files, when the credentials file holds both
    keys of ``profile`` (tensorstore 0.1.86's default chain finds no profile and goes
    anonymous); a missing config file is ``os.devnull``. None for any other file (left
    to the default chain). ``stamp``: the file's mtime and size, a cache key."""
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
    named = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE")
    if any(os.environ.get(n) for n in (*named, "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")):
        return True
    files = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser(
        "~/.aws/credentials"
    )
    return os.path.isfile(files)
