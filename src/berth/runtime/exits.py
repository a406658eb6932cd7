"""How a process ended, in words: one reading of an exit status, shared by ``berth doctor``'s
program checks and the runtimes' failure reasons, so both say the same thing.

A status is what :mod:`subprocess` reports as ``returncode``: ``0`` or more for an exit, minus
the signal number for a process a signal killed.  A container's exit code (Docker's
``State.ExitCode``) is 128 plus the signal number when a signal killed its first process,
as a shell reports it.

A SIGILL means the CPU met an instruction it does not run: a program built for another CPU
(llama.cpp built with ``-march=native`` on a CPU with AMX or AVX-512, started on one without,
or on a VM whose kernel does not enable them).  Its words say so, since "killed by SIGILL"
alone sends a user looking for a crash.
"""

from __future__ import annotations

import signal

#: What a SIGILL means for an engine's program.
ILLEGAL_INSTRUCTION = "built for instructions this CPU does not run"
#: Where a failure reason that says so sends the user for the rebuild command.
REBUILD_POINTER = "`berth doctor` gives the command that rebuilds it"
#: Docker's (and a shell's) exit code for a process killed by signal N is this plus N.
SIGNAL_EXIT_BASE = 128


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def killed_by_illegal_instruction(returncode: int | None) -> bool:
    """Whether a process with ``returncode`` (``subprocess``'s, ``None`` while it runs) was
    killed by SIGILL."""
    return returncode == -signal.SIGILL


def exit_words(returncode: int) -> str:
    """How a process that ended with ``returncode`` ended, to follow its name: ``exited with
    code 1``, ``was killed by SIGKILL``, ``was killed by SIGILL (built for instructions this
    CPU does not run)``, ``was killed by signal 77``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    words = f"was killed by {signal_name(-returncode)}"
    if killed_by_illegal_instruction(returncode):
        words += f" ({ILLEGAL_INSTRUCTION})"
    return words


def container_exit_words(exit_code: int | None) -> str:
    """How a container that ended with ``exit_code`` ended (``None``: unknown), to follow the
    word "container": ``exited with code 1``, ``exited with code 132 (SIGILL: built for
    instructions this CPU does not run)``.

    Only SIGILL is named: other codes above 128 are often a program's own choice."""
    if exit_code is None:
        return "exited with code ?"
    words = f"exited with code {exit_code}"
    if exit_code == SIGNAL_EXIT_BASE + signal.SIGILL:
        words += f" (SIGILL: {ILLEGAL_INSTRUCTION})"
    return words
