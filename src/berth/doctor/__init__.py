"""``berth doctor``: what works on this host, what does not, and the command that fixes it.

Each check is a function returning a :class:`~berth.doctor.check.Check` (a name, ``ok`` /
``warn`` / ``fail``, what was found, a hint), so each can be run and tested on its own;
:func:`~berth.doctor.run.run_checks` picks the ones a home needs.  The CLI only renders.

- :mod:`~berth.doctor.install`: Python, berth's packages, ``$BERTH_HOME`` and its secrets;
- :mod:`~berth.doctor.ports`: the leader's listener ports;
- :mod:`~berth.doctor.certs`: the CA and the listeners' certificates;
- :mod:`~berth.doctor.agent`: an agent's identity, its pinned CA and its leader;
- :mod:`~berth.doctor.engines`: engine programs, Docker and images, GPUs.
"""

from __future__ import annotations

from berth.doctor.check import Check, Verdict, failed, worst
from berth.doctor.run import run_checks

__all__ = ["Check", "Verdict", "failed", "run_checks", "worst"]
