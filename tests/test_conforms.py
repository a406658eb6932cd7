"""``conforms``: the cached protocol check the relay asks once per request."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from berth.conforms import conforms


@runtime_checkable
class _Pushes(Protocol):
    def push(self) -> None: ...


class _Yes:
    def push(self) -> None:
        return None


class _No:
    pass


def test_it_answers_as_isinstance_does_for_each_class() -> None:
    assert conforms(_Yes(), _Pushes)
    assert not conforms(_No(), _Pushes)
    # Asked again (now from the cache): the same answers.
    assert conforms(_Yes(), _Pushes)
    assert not conforms(_No(), _Pushes)


def test_the_answer_is_kept_per_class_and_protocol() -> None:
    @runtime_checkable
    class _Other(Protocol):
        def other(self) -> None: ...

    assert conforms(_Yes(), _Pushes)
    assert not conforms(_Yes(), _Other)
