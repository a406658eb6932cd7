"""schemathesis hooks of ``scripts/fuzz_admin.py``: the admin API's rules that JSON Schema
cannot state, so that the fuzzer does not draw a "valid" request the leader rightly refuses.

Loaded by schemathesis itself (``SCHEMATHESIS_HOOKS=fuzz_admin_hooks``, this folder on
``PYTHONPATH``). Each rule drops a case only while schemathesis means it to be valid (its
positive mode); every rule is enforced by the leader and tested on its own where named:

- a key's name and the names in its ``models`` are printable (Python's ``str.isprintable``:
  the schema's patterns refuse control characters, but not every unprintable character
  Unicode has, such as U+2028 or a bidirectional override), ``tests/test_keys.py``;
- a key's ``expires_at`` is in the future (the clock), ``tests/test_keys.py``;
- a key change does not set and clear the same limit in one body, ``tests/test_keys.py``;
- an ``image`` goes with the ``docker`` runtime (the leader under test runs ``process`` by
  default), ``max_adapters`` with vLLM or SGLang (llama.cpp takes every adapter at start),
  and a service's ``min_replicas`` is at most its ``max_replicas``,
  ``tests/test_admin_services.py``;
- a model path on the leader's host exists and holds a model (the file system): a valid
  ``POST /admin/models`` without ``node`` registers the small GGUF file the script made
  (``$BERTH_FUZZ_MODEL_FILE``) instead of a drawn path, so the calls that follow a
  registration (show, remove) are reached too; a valid ``POST /admin/adapters`` without
  ``node`` whose drawn path exists here (``/``, ``/tmp``) is dropped, as it is no LoRA
  adapter of its base (one that does not exist is answered 404 and kept). The paths
  themselves are ``tests/test_admin_input.py``'s.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import schemathesis

#: How far ahead an expiry must be for the leader to take it, with room for the request.
_EXPIRY_MARGIN = timedelta(minutes=1)


def _printable(value: object) -> bool:
    if isinstance(value, str):
        return value.isprintable()
    if isinstance(value, list):
        return all(_printable(item) for item in value)
    return True


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _future(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return True  # the schema's own business
    if when.tzinfo is None:
        return True
    try:
        return when.astimezone(UTC) > datetime.now(UTC) + _EXPIRY_MARGIN
    except OverflowError:
        return True


def _key_rules(method: str, body: dict[str, Any]) -> bool:
    if not _printable(body.get("name")) or not _printable(body.get("models")):
        return False
    if not _future(body.get("expires_at")):
        return False
    cleared = body.get("clear")
    return not (method == "PATCH" and isinstance(cleared, list) and set(cleared) & set(body))


def _deployment_rules(body: dict[str, Any]) -> bool:
    if body.get("image") is not None and body.get("runtime") != "docker":
        return False
    if body.get("max_adapters") is not None and body.get("engine", "llamacpp") == "llamacpp":
        return False
    low, high = body.get("min_replicas"), body.get("max_replicas", 1)
    return not (_number(low) and _number(high) and low > high)


def _keeps_the_rules(case: schemathesis.Case) -> bool:
    """Whether a valid ``case`` keeps the rules of the module docstring."""
    if not isinstance(case.body, dict):
        return True
    path, method = case.operation.path, case.operation.method.upper()
    if path.startswith("/admin/keys"):
        return _key_rules(method, case.body)
    if path in ("/admin/deployments", "/admin/services") or path.startswith("/admin/services/"):
        return _deployment_rules(case.body)
    if path == "/admin/adapters" and method == "POST" and case.body.get("node") is None:
        drawn = case.body.get("path")
        return not (isinstance(drawn, str) and os.path.lexists(drawn))
    return True


def _with_a_real_model(case: schemathesis.Case) -> schemathesis.Case:
    """``case`` with the script's model file for a valid local registration."""
    model_file = os.environ.get("BERTH_FUZZ_MODEL_FILE")
    if (
        model_file
        and case.operation.path == "/admin/models"
        and case.operation.method.upper() == "POST"
        and isinstance(case.body, dict)
        and case.body.get("node") is None
    ):
        case.body = {**case.body, "path": model_file}
    return case


def _positive(case: schemathesis.Case) -> bool:
    meta = case.meta
    return meta is not None and meta.generation.mode.is_positive


@schemathesis.hook
def filter_case(context: schemathesis.HookContext, case: schemathesis.Case) -> bool:
    """Whether to keep ``case``: every case that is meant to be invalid, and a valid one
    that keeps the rules of the module docstring."""
    return not _positive(case) or _keeps_the_rules(case)


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    """``case`` with a real model file for a valid local registration (module docstring)."""
    return _with_a_real_model(case) if _positive(case) else case


@schemathesis.hook
def before_add_examples(
    context: schemathesis.HookContext, examples: list[schemathesis.Case]
) -> None:
    """The examples phase's cases (the schema's examples, all meant to be valid; that phase
    calls neither hook above), kept and given a model file by the same rules."""
    examples[:] = [_with_a_real_model(case) for case in examples if _keeps_the_rules(case)]
