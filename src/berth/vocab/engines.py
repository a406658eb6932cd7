"""The engines and runtimes berth knows, by name, and what each engine serves beyond OpenAI's
API.

Every layer names an engine (``llamacpp``, ``vllm``, ``sglang``) or a runtime (``process``,
``docker``) by these types: the settings, the store's records, the admin API, placement and
routing. How an engine is started from its name is :mod:`berth.runtime.engines`'.
"""

from __future__ import annotations

from typing import Literal, get_args

from berth.errors import ConfigError

EngineName = Literal["llamacpp", "vllm", "sglang"]

#: Every engine name berth accepts, in the order they are listed to users.
ENGINE_NAMES: tuple[EngineName, ...] = get_args(EngineName)

RuntimeName = Literal["process", "docker"]
#: Every runtime berth knows, in the order they are listed to users.
RUNTIME_NAMES: tuple[RuntimeName, ...] = ("process", "docker")

#: The API paths beyond OpenAI's that each engine serves itself: Anthropic's Messages API
#: (``/v1/messages``, ``/v1/messages/count_tokens``) on llama.cpp's llama-server (its
#: ``tools/server/README.md``) and vLLM (its Anthropic-compatible endpoints); SGLang does not
#: document it. The proxy sends a request for one of them only to an engine listed here
#: (:func:`serves_path`).
EXTRA_PATHS: dict[str, frozenset[str]] = {
    "llamacpp": frozenset({"/v1/messages", "/v1/messages/count_tokens"}),
    "vllm": frozenset({"/v1/messages", "/v1/messages/count_tokens"}),
    "sglang": frozenset(),
}


def serves_path(engine: str | None, path: str) -> bool:
    """Whether an engine of kind ``engine`` (an :data:`EngineName`; ``None``: one berth did
    not start, an adopted endpoint, whose kind it does not know) serves ``path``, one of
    :data:`EXTRA_PATHS`'s."""
    return engine is not None and path in EXTRA_PATHS.get(engine, frozenset())


def parse_runtime_name(text: str) -> RuntimeName:
    """Return the runtime named by ``text`` (case and surrounding blanks ignored).

    Raises :class:`~berth.errors.ConfigError` naming the valid runtimes otherwise.
    """
    wanted = text.strip().lower()
    for name in RUNTIME_NAMES:
        if name == wanted:
            return name
    raise ConfigError(f"unknown runtime {text!r}: expected one of {', '.join(RUNTIME_NAMES)}")


def parse_engine_name(text: str) -> EngineName:
    """Return the engine named by ``text`` (case and surrounding blanks ignored).

    Raises :class:`~berth.errors.ConfigError` naming the valid engines when ``text`` is
    not one of them.
    """
    wanted = text.strip().lower()
    for name in ENGINE_NAMES:
        if name == wanted:
            return name
    valid = ", ".join(ENGINE_NAMES)
    raise ConfigError(f"unknown engine {text!r}: expected one of {valid}")
