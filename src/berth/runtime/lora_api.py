"""Loading and unloading LoRA adapters in a running engine, through the engine's own API.

* vLLM (its "Dynamically serving LoRA Adapters" docs; the server needs
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in its environment, which berth sets):
  ``POST /v1/load_lora_adapter`` with ``{"lora_name", "lora_path"}``, and
  ``POST /v1/unload_lora_adapter`` with ``{"lora_name"}``. It answers 400 for an adapter
  already loaded (taken here as loaded) and 400 or 404 for one it does not have on unload
  (taken as unloaded).
* SGLang (its "LoRA Serving" docs): ``POST /load_lora_adapter`` and
  ``POST /unload_lora_adapter`` with the same fields; failures are 400 with
  ``{"success": false, "error_message"}``.
* llama.cpp takes its adapters at start (``--lora``) and applies them per request: there is
  nothing to load into a running ``llama-server``.

The engine is on this host's loopback; its API key goes as ``Authorization: Bearer``.
"""

from __future__ import annotations

from typing import Final

import httpx

from berth.errors import ConfigError, EngineError
from berth.vocab.engines import EngineName

#: Seconds an engine may take to load an adapter (it reads the weights from disk).
LOAD_TIMEOUT_S: Final = 120.0

_PATHS: dict[EngineName, tuple[str, str]] = {
    "vllm": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
    "sglang": ("/load_lora_adapter", "/unload_lora_adapter"),
}


async def load_adapter(
    engine: EngineName,
    base_url: str,
    name: str,
    path: str,
    *,
    api_key: str | None,
    timeout_s: float = LOAD_TIMEOUT_S,
) -> None:
    """Have the engine at ``base_url`` load the adapter at ``path`` (on this host) as
    ``name``; an adapter it already has under that name counts as loaded.

    Raises :class:`~berth.errors.ConfigError` for llama.cpp (adapters are given at start)
    and :class:`~berth.errors.EngineError` with the engine's words when it refuses or cannot
    be reached.
    """
    load_path, _unload = _paths(engine)
    body = {"lora_name": name, "lora_path": path}
    response = await _post(base_url + load_path, body, api_key, timeout_s, f"load adapter {name}")
    if response.status_code == 200:
        return
    message = _message(response)
    if response.status_code == 400 and "already" in message.lower():
        return
    raise EngineError(f"the engine refused to load adapter {name!r}: {message}")


async def unload_adapter(
    engine: EngineName,
    base_url: str,
    name: str,
    *,
    api_key: str | None,
    timeout_s: float = LOAD_TIMEOUT_S,
) -> None:
    """Have the engine at ``base_url`` unload the adapter ``name``; one it does not have
    counts as unloaded. Raises as :func:`load_adapter`."""
    _load, unload_path = _paths(engine)
    body = {"lora_name": name}
    response = await _post(base_url + unload_path, body, api_key, timeout_s, f"unload {name}")
    if response.status_code == 200 or response.status_code == 404:
        return
    message = _message(response)
    lowered = message.lower()
    if response.status_code == 400 and ("not found" in lowered or "cannot be found" in lowered):
        return
    raise EngineError(f"the engine refused to unload adapter {name!r}: {message}")


def _paths(engine: EngineName) -> tuple[str, str]:
    paths = _PATHS.get(engine)
    if paths is None:
        raise ConfigError(
            f"{engine} takes its adapters when it starts (--lora): restart the deployment "
            "to give it a new one"
        )
    return paths


async def _post(
    url: str, body: dict[str, str], api_key: str | None, timeout_s: float, what: str
) -> httpx.Response:
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(trust_env=False, headers=headers) as client:
        try:
            return await client.post(url, json=body, timeout=timeout_s)
        except httpx.TimeoutException:
            raise EngineError(f"the engine did not {what} within {timeout_s:g} s") from None
        except httpx.TransportError as exc:
            raise EngineError(f"cannot reach the engine to {what}: {exc}") from None


def _message(response: httpx.Response) -> str:
    """The engine's reason: an OpenAI-style ``error.message``, SGLang's ``error_message``,
    FastAPI's ``detail``, or the body's first 200 characters."""
    try:
        payload = response.json()
    except ValueError:
        return response.text[:200] or f"HTTP {response.status_code}"
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for key in ("error_message", "message", "detail"):
            if isinstance(payload.get(key), str):
                return str(payload[key])
    return response.text[:200]
