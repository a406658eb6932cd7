"""Key and limit changes written by another leader on the same database, taken on at once.

Each leader caches keys twice: the :class:`~berth.auth.authenticator.Authenticator` (records by
secret, invalid secrets) and :class:`~berth.admission.Admission` (each key's limits).  The
admin API of the leader that makes a change clears its own caches; :class:`KeySync` clears
every other leader's, from the store's ``keys`` change feed (:mod:`berth.store.changes`:
PostgreSQL ``LISTEN/NOTIFY``, milliseconds; on SQLite a counter read every ``poll_s``,
0.25 s by default).

On a change the changed keys leave the authenticator's cache at once (their next request
reads the store, so a revoked key is refused from then on; the other keys are served on), and
admission takes the changed keys' records on: those named, or, when the feed only knows
"something changed", every key (and every key is read again by the authenticator).
"""

from __future__ import annotations

import asyncio
import logging

from berth.admission import Admission
from berth.auth.authenticator import Authenticator
from berth.errors import NotFoundError, StoreError
from berth.store import Store
from berth.store.changes import KEYS_TOPIC, ChangeFeed
from berth.vocab.records import ApiKeyRecord

_log = logging.getLogger(__name__)


class KeySync:
    """Follow ``store``'s key changes into ``authenticator`` and ``admission`` (see the
    module doc); :meth:`start` and :meth:`stop` it with the leader."""

    def __init__(
        self,
        store: Store,
        authenticator: Authenticator,
        admission: Admission,
        *,
        poll_s: float | None = None,
    ) -> None:
        self._store = store
        self._authenticator = authenticator
        self._admission = admission
        self._feed: ChangeFeed = store.change_feed(KEYS_TOPIC, self._changed, poll_s=poll_s)
        self._reloads: set[asyncio.Task[None]] = set()
        #: changes taken on so far (for tests and logs)
        self.changes = 0

    @property
    def reloading(self) -> bool:
        """Whether admission is still taking changed keys on."""
        return bool(self._reloads)

    async def start(self) -> None:
        """Start following (changes already in the store are not news)."""
        await self._feed.start()

    async def stop(self) -> None:
        """Stop following; admission reloads under way are cancelled."""
        await self._feed.stop()
        for task in list(self._reloads):
            task.cancel()
        self._reloads.clear()

    def _changed(self, ids: frozenset[str] | None) -> None:
        if ids is None:
            self._authenticator.forget_all()
        else:
            self._authenticator.forget(ids)
        self.changes += 1
        task = asyncio.create_task(self._reload(ids), name="key-sync")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _reload(self, ids: frozenset[str] | None) -> None:
        try:
            records = await asyncio.to_thread(self._records, ids)
        except StoreError as exc:
            _log.warning("key sync: cannot read the changed keys: %s", exc)
            return
        for record in records:
            self._admission.update(record)

    def _records(self, ids: frozenset[str] | None) -> list[ApiKeyRecord]:
        if ids is None:
            return self._store.list_api_keys()
        found: list[ApiKeyRecord] = []
        for ident in sorted(ids):
            try:
                found.append(self._store.lookup_api_key(ident))
            except NotFoundError:
                continue  # gone already: nothing to take on
        return found
