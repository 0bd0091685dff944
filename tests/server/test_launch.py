"""``serve`` loads the model off the main thread (launch.off_the_main_thread): what it hands back and raises."""

from __future__ import annotations

import threading

import pytest

from radixserve.server.launch import off_the_main_thread


def test_the_build_runs_on_a_thread_that_has_ended_and_its_result_comes_back() -> None:
    built_on: list[threading.Thread] = []

    def build() -> str:
        built_on.append(threading.current_thread())
        return "engine"

    assert off_the_main_thread(build) == "engine"
    (thread,) = built_on
    assert thread is not threading.main_thread() and not thread.is_alive()  # its OpenMP pool ended with it


def test_a_failed_build_raises_on_the_caller() -> None:
    def build() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        off_the_main_thread(build)
