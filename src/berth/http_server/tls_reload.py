"""A TLS listener's certificate replaced while it serves (:class:`ReloadingTLS`).

The operator (or certbot, or berth itself) writes a new certificate and key over the files a
listener serves; on ``SIGHUP`` or when the files change, the listener takes the new pair for
its *new* connections, and connections already open go on with the pair they shook hands
with. A pair that is not whole and right is never served: the listener keeps the pair it has
and logs one warning naming both paths and the reason (servers that swapped in a half-written
pair lost their listener: bun#43815, netpulse#769).

**Validation** (:func:`load_pair`, in this order, the first failure is the reason): both files
read; every PEM block of the certificate file is whole (as many ``END`` lines as ``BEGIN``
lines: a file cut off in its chain still parses its leaf); every certificate of the chain and
the key parse;
the key is the leaf's; the leaf has not expired; OpenSSL accepts the pair and loads the chain
into a fresh :class:`ssl.SSLContext` (built by the listener's own context builder); and the
files still hold the bytes checked (else they changed while being read: the next poll reads
them again).

**The swap.** The listener's server is given one context for good (:attr:`ReloadingTLS.context`,
the first pair's); its ``sni_callback`` runs on every ClientHello, with or without a server
name, and points that handshake's :class:`ssl.SSLObject` at the context of the newest
validated pair (``SSL_set_SSL_CTX``). A reload builds a *new* context and replaces one
reference on the event loop's thread, so a handshake sees the old pair or the new one, never
a mixture, and the contexts of open connections are never touched. Reloading into the live
context instead (``load_cert_chain`` on it) is not atomic: OpenSSL sets the certificate
before it checks the key, and a key that then fails leaves the live context with the new
certificate and no key at all, which breaks every later handshake, a change of the files
between a check on a scratch context and the live load included.

**File changes** are found by polling (no inotify dependency): every ``interval_s`` the
listener compares each file's (mtime, size, inode) with those of the pair it serves. A
change is read only once it has held still for one whole interval, so a pair written in two
steps (certificate, then key) is read once both are written. A pair refused is not read again
until a file changes again; ``SIGHUP`` reads the files at once, whatever their stamps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from berth.errors import BerthError

log = logging.getLogger(__name__)

#: Builds a listener's server context from a certificate and a key file (it may raise
#: :class:`ssl.SSLError`, :class:`OSError` or :class:`~berth.errors.BerthError`).
ContextBuilder = Callable[[Path, Path], ssl.SSLContext]

#: Seconds between two looks at the files (the ``tls_reload_interval_s`` setting's default).
DEFAULT_INTERVAL_S: Final = 5.0

#: One file's (mtime in ns, size in bytes, inode), or ``None`` when it cannot be stat'ed.
FileStamp = tuple[int, int, int] | None
#: The certificate file's stamp and the key file's.
PairStamp = tuple[FileStamp, FileStamp]


class PairRefused(BerthError):
    """A certificate pair that must not be served; ``reason`` says why in a few words."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class ServedPair:
    """A validated pair: its server ``context``, the leaf's ``serial`` and ``not_after``
    (aware, UTC), and the files' ``stamp`` as they were before they were read."""

    context: ssl.SSLContext
    serial: int
    not_after: datetime
    stamp: PairStamp

    @property
    def serial_hex(self) -> str:
        """The serial as OpenSSL prints it: upper-case hex, no prefix."""
        return f"{self.serial:X}"


def file_stamp(path: Path) -> FileStamp:
    """``path``'s (mtime in ns, size, inode), or ``None`` when it cannot be stat'ed."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size, info.st_ino)


def pair_stamp(cert_path: Path, key_path: Path) -> PairStamp:
    """The stamps of a certificate file and its key file."""
    return (file_stamp(cert_path), file_stamp(key_path))


PollStep = Literal["idle", "settling", "read"]


def poll_step(
    now: PairStamp, previous: PairStamp, served: PairStamp, refused: PairStamp | None
) -> PollStep:
    """What one poll does, from the files' stamps ``now``, at the previous poll, of the pair
    served and of the pair last refused (``None``: none was).

    ``idle``: nothing changed since the pair served or refused; ``settling``: the files
    changed since the previous poll (they may still be being written: look again next time);
    ``read``: they differ from the pair served and held still for a whole interval.
    """
    if now in (served, refused):
        return "idle"
    if now != previous:
        return "settling"
    return "read"


def load_pair(
    cert_path: Path,
    key_path: Path,
    build: ContextBuilder,
    *,
    now: datetime | None = None,
    refuse_expired: bool = True,
) -> ServedPair:
    """Validate the pair in ``cert_path`` and ``key_path`` (PEM) and build its context with
    ``build``; the checks and their order are in the module docstring.

    ``now`` (aware; default the current time) is what expiry is judged against; an expired
    leaf is refused only with ``refuse_expired`` (a listener's first pair is served as the
    operator gave it, as before reloading existed). Raises :class:`PairRefused` with the
    reason.
    """
    stamp = pair_stamp(cert_path, key_path)
    cert_pem = _read(cert_path, "the certificate")
    key_pem = _read(key_path, "the key")
    begins, ends = cert_pem.count(b"-----BEGIN "), cert_pem.count(b"-----END ")
    if begins == 0:
        raise PairRefused("the certificate file holds no PEM block")
    if begins != ends:
        raise PairRefused(
            f"the certificate file is cut off ({begins} BEGIN lines, {ends} END lines): "
            "half-written?"
        )
    # A key may share the file (OpenSSL skips it); the certificates are counted on their own.
    if cert_pem.count(b"-----BEGIN CERTIFICATE-----") == 0:
        raise PairRefused("the certificate file holds no certificate")
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError as exc:
        raise PairRefused(f"the certificate does not parse ({_short(exc)})") from None
    if len(chain) != cert_pem.count(b"-----BEGIN CERTIFICATE-----"):
        raise PairRefused("a certificate of the file's chain does not parse")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise PairRefused(f"the key does not parse ({_short(exc)})") from None
    leaf = chain[0]
    if key.public_key() != leaf.public_key():
        raise PairRefused("the key is not the certificate's (mismatched pair)")
    when = now or datetime.now(UTC)
    if refuse_expired and leaf.not_valid_after_utc <= when:
        raise PairRefused(
            f"the certificate expired at {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        )
    try:
        context = build(cert_path, key_path)
    except ssl.SSLError as exc:
        raise PairRefused(f"OpenSSL refuses the pair ({exc.reason or exc})") from None
    except (OSError, BerthError) as exc:
        raise PairRefused(f"the context could not be built ({exc})") from None
    if _read(cert_path, "the certificate") != cert_pem or _read(key_path, "the key") != key_pem:
        raise PairRefused("the files changed while they were read (read again at the next change)")
    return ServedPair(context, leaf.serial_number, leaf.not_valid_after_utc, stamp)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PairRefused(f"{what} cannot be read ({exc.strerror or exc})") from None


def _short(exc: Exception) -> str:
    return str(exc).split(". See https://", 1)[0] or type(exc).__name__


ReloadResult = Literal["reloaded", "kept", "unchanged"]


class ReloadingTLS:
    """One listener's certificate pair, reloadable while the listener serves.

    Build it with :meth:`load` (the first pair); give :attr:`context` to the server; call
    :meth:`reload` on ``SIGHUP`` and run :meth:`watch` as a task. ``name`` labels log lines
    (``public``, ``cluster``); ``build`` makes a server context from the two paths (the
    listener's own settings: protocols, ALPN, client trust).
    """

    def __init__(
        self, name: str, cert_path: Path, key_path: Path, build: ContextBuilder, first: ServedPair
    ) -> None:
        self.name = name
        self.cert_path = cert_path
        self.key_path = key_path
        self._build = build
        self._served = first
        self._front = first.context
        self._front.sni_callback = self._choose_context
        self._seen: PairStamp = first.stamp
        self._refused: PairStamp | None = None

    @classmethod
    def load(
        cls, name: str, cert_path: Path, key_path: Path, build: ContextBuilder
    ) -> ReloadingTLS:
        """The listener's first pair. ``build``'s own errors pass through unchanged (a start
        fails as it did before reloading existed); a pair OpenSSL takes that fails a later
        check raises :class:`PairRefused`. An expired leaf is served (and logged)."""
        build(cert_path, key_path)  # its errors, naming the settings, come first
        first = load_pair(cert_path, key_path, build, refuse_expired=False)
        log.info("%s listener: certificate serial %s, notAfter %s (%s)", name, first.serial_hex,
                 f"{first.not_after:%Y-%m-%d %H:%M:%S} UTC", cert_path)  # fmt: skip
        if first.not_after <= datetime.now(UTC):
            log.warning("%s listener: the certificate %s expired at %s", name, cert_path,
                        f"{first.not_after:%Y-%m-%d %H:%M} UTC")  # fmt: skip
        return cls(name, cert_path, key_path, build, first)

    @property
    def context(self) -> ssl.SSLContext:
        """The context to give the server, for good (it hands each handshake the newest)."""
        return self._front

    @property
    def served(self) -> ServedPair:
        """The pair new connections get now."""
        return self._served

    def _choose_context(
        self, ssl_object: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None,
        context: ssl.SSLContext,
    ) -> None:  # fmt: skip
        newest = self._served.context
        if newest is not context:
            ssl_object.context = newest

    async def reload(self, *, reason: str = "SIGHUP") -> ReloadResult:
        """Read and validate the files now (in a worker thread) and serve them if they pass
        (``reloaded``); ``kept`` (logged as one warning) when they do not; ``unchanged`` when
        they hold the pair served already. ``reason`` goes in the log line."""
        stamp = pair_stamp(self.cert_path, self.key_path)
        try:
            pair = await asyncio.to_thread(load_pair, self.cert_path, self.key_path, self._build)
        except PairRefused as exc:
            self._refused = self._seen = stamp
            log.warning(
                "%s listener: %s: %s and %s refused, still serving serial %s: %s",
                self.name, reason, self.cert_path, self.key_path, self._served.serial_hex,
                exc.reason,
            )  # fmt: skip
            return "kept"
        self._seen, self._refused = pair.stamp, None
        if (pair.serial, pair.stamp) == (self._served.serial, self._served.stamp):
            log.info("%s listener: %s: certificate unchanged (serial %s)", self.name, reason,
                     pair.serial_hex)  # fmt: skip
            return "unchanged"
        self._served = pair
        log.info(
            "%s listener: %s: new certificate serial %s, notAfter %s (%s)",
            self.name, reason, pair.serial_hex, f"{pair.not_after:%Y-%m-%d %H:%M:%S} UTC",
            self.cert_path,
        )  # fmt: skip
        return "reloaded"

    async def poll(self) -> ReloadResult:
        """One look at the files (see the module docstring): ``unchanged`` unless they
        changed and held still since the previous look."""
        now = pair_stamp(self.cert_path, self.key_path)
        step = poll_step(now, self._seen, self._served.stamp, self._refused)
        self._seen = now
        if step != "read":
            return "unchanged"
        return await self.reload(reason="the files changed")

    async def watch(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        """Poll every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll()
            except Exception:  # the watch must outlive any one look; the log says what broke
                log.exception("%s listener: the certificate watch failed", self.name)


class CertificateReloads:
    """Several listeners' pairs, watched together (:meth:`start`) and reloaded together on a
    signal (:meth:`reload_all`, safe to call from a loop signal handler)."""

    def __init__(self, pairs: list[ReloadingTLS], *, interval_s: float = DEFAULT_INTERVAL_S):
        self.pairs = pairs
        self._interval_s = interval_s
        self._tasks: set[asyncio.Task[object]] = set()

    def start(self) -> None:
        """Start one watch task per pair on the running loop."""
        for pair in self.pairs:
            self._spawn(pair.watch(self._interval_s))

    def reload_all(self) -> None:
        """Reload every pair now, each in its own task (a ``SIGHUP``)."""
        for pair in self.pairs:
            self._spawn(pair.reload())

    def _spawn(self, work: Coroutine[object, object, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the watches and any reload still running."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
