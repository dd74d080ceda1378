"""Test setup: 8 CPU devices for sharding tests, set before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts several jax processes")
    config.addinivalue_line("markers", "s3: starts a local S3-compatible server")


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 CPU devices (XLA_FLAGS set too late?)"
    return devs
