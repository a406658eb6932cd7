"""The admin API's client over the daemon's Unix socket (``$BERTH_HOME/berth.sock``), for the
CLI and ``berth doctor``.

The socket is mode 0600, so reaching it proves the caller is the daemon's owner and no key
is sent.  Errors come back in the OpenAI error shape and are raised as ``BerthError`` with the
daemon's message, so the CLI prints one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import httpx

from berth.errors import BerthError, DaemonError
from berth.paths import BerthHome, resolve_home

#: Seconds to wait for an ordinary admin call.
DEFAULT_TIMEOUT_S = 30.0


class DaemonClient:
    """Talks to the daemon of one ``BerthHome`` over its socket."""

    def __init__(self, home: BerthHome, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.home = home
        self._client = httpx.Client(
            # verify=False: no TLS on a Unix socket, and it skips loading a CA bundle.
            transport=httpx.HTTPTransport(uds=str(home.socket_file), verify=False),
            base_url="http://berth",
            timeout=timeout_s,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def is_running(self) -> bool:
        """Whether a daemon answers on the socket."""
        if not self.home.socket_file.exists():
            return False
        try:
            self._client.get("/healthz", timeout=2.0)
        except httpx.TransportError:
            return False
        return True

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one admin call and return the decoded JSON body.

        Raises ``DaemonError`` when no daemon answers and ``BerthError`` carrying the
        daemon's message for any error status.
        """
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._not_running() from exc
        _raise_for_error(response)
        return response.json()

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.request("POST", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> Any:
        return self.request("DELETE", path, **kwargs)

    @contextmanager
    def stream(self, path: str, **params: Any) -> Iterator[Iterator[bytes]]:
        """GET ``path`` and yield an iterator over the raw body chunks (no read timeout)."""
        try:
            with self._client.stream(
                "GET", path, params=params, timeout=httpx.Timeout(10.0, read=None)
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_error(response)
                yield response.iter_bytes()
        except httpx.TransportError as exc:
            raise self._not_running() from exc

    def _not_running(self) -> DaemonError:
        command = "berth daemon start"
        if self.home.root != resolve_home():
            command = f"berth --home {self.home.root} daemon start"
        return DaemonError(
            f"berth daemon is not running (no answer on {self.home.socket_file}); "
            f"start it with: {command}"
        )


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    message = response.text
    with suppress(ValueError, KeyError, TypeError):
        message = response.json()["error"]["message"]
    error = BerthError(message)
    error.http_status = response.status_code
    # The daemon refused the input (bad value, unknown name, conflict): a usage error.
    error.exit_code = 2 if response.status_code in (400, 404, 409, 413, 422) else 1
    raise error
