"""How a setting's value is told to whoever asks (``berth config show``, ``/admin/config``):
where it came from (:data:`SettingSource`) and the JSON form it is shown in
(:data:`JsonScalar`). Resolving settings is :mod:`berth.config`'s job."""

from __future__ import annotations

from typing import Literal

#: Where a setting's value came from, highest precedence first: a command-line flag, a
#: ``BERTH_*`` environment variable, ``config.toml``, what berth found on this host, the
#: default.
SettingSource = Literal["flag", "env", "file", "autodetect", "default"]

#: A setting's value in JSON: a path as text, a number, a flag, or ``null`` for none.
JsonScalar = str | int | float | bool | None
