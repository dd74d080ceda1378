"""deferred_sigint: a real SIGINT (os.kill of this process) inside the block is held,
never raised inside it (nor dropped where Python drops exceptions), and handed to the
previous handler, restored exactly, once the block is over.

Every signal here is sent inside a deferral, so it can never reach pytest itself."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from flax_orbax_plugin._base.interrupts import deferred_sigint


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10_000):  # bytecodes: where Python would run a Python-level handler
        pass


def test_a_sigint_in_the_block_is_raised_at_its_end_not_inside():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            _ctrl_c()
            done.append("the block ran to its end")
    assert done == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_previous_handler_is_restored_exactly_and_runs_once():
    calls = []

    def handler(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        with deferred_sigint():
            _ctrl_c()
            _ctrl_c()
            assert calls == []
        assert calls == [signal.SIGINT]  # several during the block count as one
        assert signal.getsignal(signal.SIGINT) is handler
        with deferred_sigint():  # nothing arrived: nothing runs
            pass
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


class _DropsErrors:
    """Its ``__del__`` receives the Ctrl-C: Python reports and drops any exception
    raised there (as it does in a gc callback or a callback of a C library)."""

    def __del__(self):
        _ctrl_c()


def test_a_sigint_where_python_drops_exceptions_is_not_lost(capsys):
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            _DropsErrors()  # collected at once: the signal arrives inside __del__
    assert "Exception ignored" not in capsys.readouterr().err


def test_an_inner_block_hands_the_signal_to_the_outer_one():
    order = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            with deferred_sigint():
                _ctrl_c()
            order.append("after the inner block")
    assert order == ["after the inner block"]


def test_off_the_main_thread_the_handler_is_left_alone():
    seen = []

    def work():
        with deferred_sigint():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]
