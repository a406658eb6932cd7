"""The desk worker's errors.

::

    BerthError
    └── DeskError                  anything the desk worker raises on purpose
        ├── DeskUnreachableError   no answer from the desk (refused, reset, timed out)
        ├── DeskRefusedError       the desk answered an error status (``status``, its message)
        ├── DeskProtocolError      the desk answered something the protocol does not allow
        ├── SealedPromptError      a sealed prompt that does not open (``job_id``)
        ├── LeaderUnavailableError the berth leader is not running or could not be reached
        └── LeaderAnswerError      the leader (or the engine behind it) answered an error

None of these messages ever carries a prompt or an answer: they are logged.
"""

from __future__ import annotations

from berth.errors import BerthError


class DeskError(BerthError):
    """Base class of the desk worker's errors."""


class DeskUnreachableError(DeskError):
    """The desk at ``url`` did not answer (connection refused or reset, TLS, timeout)."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(f"the desk at {url} did not answer: {reason}")


class DeskRefusedError(DeskError):
    """The desk answered ``status`` (4xx or 5xx) to ``call``; ``message`` is its ``error``."""

    def __init__(self, call: str, status: int, message: str) -> None:
        self.call = call
        self.status = status
        self.message = message
        detail = f": {message}" if message else ""
        super().__init__(f"the desk refused {call} with HTTP {status}{detail}")


class DeskProtocolError(DeskError):
    """The desk's answer to ``call`` is not what the protocol allows (bad JSON, fields)."""

    def __init__(self, call: str, problem: str) -> None:
        self.call = call
        self.problem = problem
        super().__init__(f"the desk's answer to {call} is malformed: {problem}")


class SealedPromptError(DeskError):
    """The sealed prompt of job ``job_id`` does not open; ``step`` names what failed."""

    def __init__(self, job_id: str, step: str) -> None:
        self.job_id = job_id
        self.step = step
        super().__init__(f"the sealed prompt does not open ({step})")


class LeaderUnavailableError(DeskError):
    """No berth leader answers on the socket ``socket_path``."""

    exit_code = 3

    def __init__(self, socket_path: str, reason: str) -> None:
        self.socket_path = socket_path
        self.reason = reason
        super().__init__(
            f"the berth leader does not answer on {socket_path} ({reason}); "
            "start it with: berth daemon start"
        )


class LeaderAnswerError(DeskError):
    """The leader answered ``status`` to ``call``; ``kind`` is the OpenAI error type (or
    what was wrong with the answer). ``status`` 0 means no answer came in time (``kind``
    ``"timeout"``, ``message`` saying how long was waited).
    """

    def __init__(self, call: str, status: int, kind: str, message: str = "") -> None:
        self.call = call
        self.status = status
        self.kind = kind
        if status == 0:
            text = f"the leader did not answer {call} {message}".rstrip()
        else:
            detail = f": {message}" if message else ""
            text = f"the leader answered {call} with {status} ({kind}){detail}"
        super().__init__(text)
