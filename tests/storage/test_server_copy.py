"""Server-side copies inside one bucket, against the real S3 server (moto) and the GCS
emulator: list, copy only from the object listed, delete; no copier where none works."""

import pytest

from flax_orbax_plugin._storage import server_copy as _server_copy
from flax_orbax_plugin._storage.location import Location

pytest_plugins = ["_servers"]


@pytest.fixture(params=["s3", "gcs"])
def bucket(request):
    return request.getfixturevalue(f"{request.param}_location")


def test_copy_list_and_delete(bucket):
    loc = Location.from_path(bucket.url)
    data = bytes(range(256)) * 40
    loc.write_bytes("a/x/1", data)
    loc.write_bytes("a/y", b"other")
    copier, why = _server_copy.copier_for(loc)
    assert copier is not None and why == ""
    root = bucket.prefix + "/"
    listed = copier.list(root + "a/x/")
    assert list(listed) == [root + "a/x/1"] and listed[root + "a/x/1"].size == len(data)
    answer = copier.copy(root + "a/x/1", root + "b/1", listed[root + "a/x/1"])
    assert answer.size == len(data) and answer.tag == listed[root + "a/x/1"].tag
    assert bucket.read("b/1") == data  # the copy holds the bytes, under its own key
    assert copier.list(root + "b/")[root + "b/1"].tag == answer.tag
    copier.delete(root + "b/1")
    copier.delete(root + "b/1")  # absent: no error
    assert copier.list(root + "b/") == {} and bucket.read("a/x/1") == data


def test_read_range_reads_the_bytes_asked_for(bucket):
    """What ``_incremental`` reads of a source chunk: its last 4 bytes (the crc32c
    trailer), pinned to the object listed; a range past the end is an error."""
    loc = Location.from_path(bucket.url)
    data = bytes(range(256)) * 40
    loc.write_bytes("a/x", data)
    copier, _ = _server_copy.copier_for(loc)
    key = bucket.prefix + "/a/x"
    info = copier.list(key)[key]
    assert copier.read_range(key, len(data) - 4, len(data), info) == data[-4:]
    assert copier.read_range(key, 10, 20, info) == data[10:20]
    with pytest.raises(_server_copy.CopyError):
        copier.read_range(key, len(data) - 4, len(data) + 4, info)  # the store has fewer


def test_a_source_changed_since_it_was_listed_is_never_taken_for_it(bucket):
    """The copy is made only from the object listed (S3 If-Match, GCS generation match:
    refused by real stores; moto and the emulator ignore both and copy the new bytes),
    and where a store copies anyway, its answer carries the new tag, which
    ``_incremental`` compares with the listed one."""
    from flax_orbax_plugin._incremental import reuse as _incremental

    loc = Location.from_path(bucket.url)
    loc.write_bytes("src", b"first version")
    copier, _ = _server_copy.copier_for(loc)
    root = bucket.prefix + "/"
    before = copier.list(root + "src")[root + "src"]
    loc.write_bytes("src", b"other version")  # the same size
    try:
        answer = copier.copy(root + "src", root + "dst", before)
    except _server_copy.CopyError:
        assert bucket.read("dst") is None
        return
    assert answer.tag != before.tag
    assert not _incremental._same_copy(before, answer, copier.list(root + "dst")[root + "dst"])


def test_no_copier_for_other_drivers(tmp_path):
    for url in ("memory://x", str(tmp_path)):
        copier, why = _server_copy.copier_for(Location.from_path(url))
        assert copier is None and "no server-side copy" in why


def test_no_gcs_copier_without_google_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
    monkeypatch.delenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "absent.json"))
    copier, why = _server_copy.copier_for(Location.from_path("gs://some-bucket/run"))
    assert copier is None and ("google-auth" in why or "no credentials" in why)


def test_no_s3_copier_without_aws_credentials(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "absent"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata lookup
    copier, why = _server_copy.copier_for(Location.from_path("s3://some-bucket/run"))
    assert copier is None and "no AWS credentials" in why
