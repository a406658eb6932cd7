"""The state database: SQLAlchemy 2 models, versioned migrations, the :class:`Store` facade.

Callers use :class:`Store`, which takes and returns the frozen records of
:mod:`berth.vocab.records` (and :mod:`berth.vocab.drains`); the ORM tables stay inside this
package.
"""

from berth.store.migrations import LATEST_VERSION
from berth.store.store import Store
from berth.store.values import UNCHANGED, Unchanged

__all__ = ["LATEST_VERSION", "UNCHANGED", "Store", "Unchanged"]
