"""How a process or a container ended, in words (``berth.runtime.exits``): the one reading
the runtimes' failure reasons and ``berth doctor`` share."""

from __future__ import annotations

import signal

import pytest

from berth.runtime.exits import container_exit_words, exit_words, killed_by_illegal_instruction


@pytest.mark.parametrize(
    ("returncode", "words"),
    [
        (0, "exited with code 0"),
        (1, "exited with code 1"),
        (132, "exited with code 132"),  # a program's own exit code, not a signal
        (-signal.SIGKILL, "was killed by SIGKILL"),
        (-signal.SIGSEGV, "was killed by SIGSEGV"),
        (-signal.SIGILL, "was killed by SIGILL (built for instructions this CPU does not run)"),
        (-77, "was killed by signal 77"),
    ],
)
def test_an_exit_status_in_words(returncode: int, words: str) -> None:
    assert exit_words(returncode) == words
    assert killed_by_illegal_instruction(returncode) is (returncode == -signal.SIGILL)


@pytest.mark.parametrize(
    ("exit_code", "words"),
    [
        (None, "exited with code ?"),
        (2, "exited with code 2"),
        (137, "exited with code 137"),
        (132, "exited with code 132 (SIGILL: built for instructions this CPU does not run)"),
    ],
)
def test_a_containers_exit_code_in_words(exit_code: int | None, words: str) -> None:
    assert container_exit_words(exit_code) == words
