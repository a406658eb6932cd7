"""A cheap ``isinstance`` against a ``runtime_checkable`` protocol, for hot paths.

On Python 3.11 ``isinstance(obj, SomeProtocol)`` looks up every member of the protocol on
every call (about 16 µs for the relay's protocols on this project's benchmark machine), which
is more than the rest of a short request's relay. Whether a class conforms does not change
while it runs, so :func:`conforms` asks once per class and protocol and remembers the answer.
"""

from __future__ import annotations

_answers: dict[tuple[type, type], bool] = {}


def conforms(obj: object, protocol: type) -> bool:
    """``isinstance(obj, protocol)`` for a ``runtime_checkable`` ``protocol``, decided once
    per class of ``obj`` (an instance attribute that a protocol member names is not
    considered after the first answer, so use it for protocols of methods and class-level
    properties only). Beside each protocol, a ``TypeGuard`` function built on it narrows the
    type for the caller (mypy takes no protocol class where ``type[T]`` is asked)."""
    key = (type(obj), protocol)
    answer = _answers.get(key)
    if answer is None:
        answer = _answers[key] = isinstance(obj, protocol)
    return answer
