"""Test setup: 8 CPU devices for sharding tests, set before jax is imported."""

import gc
import os
import signal

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

# A suite started as a script's background job (`pytest ... &`) ignores SIGINT, and so
# would every command it starts: the tests that interrupt a command with Ctrl-C need it
# taken, as from a terminal (the command line keeps a signal it was started ignoring).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_SERVER_FIXTURES = {"s3": ("s3_server", "s3_location"), "gcs": ("gcs_server", "gcs_location")}


# A test module that starts processes (a CLI run, several JAX processes, a kill): its
# tests take seconds each, where most others take milliseconds.
_STARTS_PROCESSES = ("subprocess", "_multiprocess", "_proc")


def pytest_collection_modifyitems(items):
    """Every test that uses a server fixture carries its marker (registered in
    pyproject.toml), so ``-m 'not s3 and not gcs'`` deselects them all. The modules that
    start processes run first (each module's tests keep their order): the workers begin
    with the long tests and end on short ones, so no long test is left for the end."""
    for item in items:
        for marker, fixtures in _SERVER_FIXTURES.items():
            if any(f in getattr(item, "fixturenames", ()) for f in fixtures):
                item.add_marker(marker)
    slow: dict[str, bool] = {}

    def starts_processes(item) -> bool:
        path = str(item.path)
        if path not in slow:
            source = item.path.read_text() if item.path.suffix == ".py" else ""
            slow[path] = any(word in source for word in _STARTS_PROCESSES)
        return slow[path]

    items.sort(key=lambda item: not starts_processes(item))


def pytest_collection_finish(session):
    """What is loaded once collected (jax, numpy, the package, every test module and
    item: most of a worker's objects) is moved out of the collector's reach, so each
    full collection during the run walks only what the tests made since (it walked the
    whole heap: ~0.1 s each, dozens per worker). Freezing only keeps those objects
    alive; nothing a test makes is frozen."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 CPU devices (XLA_FLAGS set too late?)"
    return devs
