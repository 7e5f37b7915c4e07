"""tests/cuda_emulation's isolation: what an emulated kernel does to its process (an abort, a
failed check) fails the test with a message and leaves the interpreter running."""

import faulthandler
import os

import pytest

import cuda_emulation


def _abort_quietly():
    faulthandler.disable()  # the child's stack dump would only clutter the test run's output
    os.abort()


def test_an_abort_fails_the_test():
    with pytest.raises(pytest.fail.Exception, match="SIGABRT"):
        cuda_emulation.run_isolated(_abort_quietly)


def test_a_failed_assertion_comes_back_with_its_text():
    def fails():
        assert 1 + 1 == 3, "the child's own message"

    with pytest.raises(pytest.fail.Exception, match="the child's own message"):
        cuda_emulation.run_isolated(fails)


def test_a_skip_stays_a_skip():
    with pytest.raises(pytest.skip.Exception, match="not here"):
        cuda_emulation.run_isolated(lambda: pytest.skip("not here"))


def test_a_passing_test_passes():
    cuda_emulation.run_isolated(lambda: None)
