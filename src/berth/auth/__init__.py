"""Who a request is from: API-key authentication on the leader's listeners.

Owns the :class:`~berth.auth.authenticator.Authenticator` (a key's secret to its record, with
a short cache in front of the store, a negative cache of unknown secrets and a bound on the
store reads for them; :mod:`.authenticator`), the limit on failed attempts per client address
(:mod:`.limiter`, pure), its Prometheus series (:mod:`.metrics`) and the key changes other
leaders write, followed into the caches and admission (:mod:`.key_sync`). The daemon's
listeners, the console's sign-in and the admin key routes use it; the gateway gets a
request's key record from the daemon.

May import :mod:`berth.admission`, :mod:`berth.store`, the vocabulary and the base modules.
"""
