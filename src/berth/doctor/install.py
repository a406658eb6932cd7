"""Checks of the installation: the Python interpreter, berth's packages, ``$BERTH_HOME`` and
the private files in it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import pwd
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet

from berth.cluster.pki.ca import CA_KEY_FILE
from berth.doctor.check import Check
from berth.paths import BerthHome

#: The packages whose versions the report shows (every requirement is checked).
KEY_PACKAGES = (
    "fastapi",
    "httptools",
    "httpx",
    "cryptography",
    "SQLAlchemy",
    "aiohttp",
    "msgspec",
    "docker",
    "nvidia-ml-py",
    "openai",
)
#: Server keys the leader issues for its own listeners, under ``ca/``.
SERVER_KEY_FILES = ("public.key", "cluster.key")
_REINSTALL = "pip install --upgrade berth (from a checkout: pip install -e .)"


def python_check(distribution: str = "berth") -> Check:
    """The running interpreter against the package's ``Requires-Python``."""
    running = platform.python_version()
    detail = f"Python {running} ({sys.executable})"
    try:
        wanted = importlib.metadata.metadata(distribution)["Requires-Python"]
    except importlib.metadata.PackageNotFoundError:
        wanted = None
    if wanted and not SpecifierSet(wanted).contains(running, prereleases=True):
        return Check(
            "python",
            "fail",
            f"{detail}; {distribution} needs Python {wanted}",
            f"install berth with a Python {wanted} interpreter",
        )
    return Check("python", "ok", detail)


def packages_check(distribution: str = "berth", shown: Sequence[str] = KEY_PACKAGES) -> Check:
    """Every requirement of ``distribution`` (extras aside) installed at an allowed version.

    The detail lists the version of ``distribution`` and of the ``shown`` packages; the
    verdict fails for a missing package or one outside its specifier, with the ``pip``
    command that fixes it.
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return Check(
            "packages",
            "warn",
            f"{distribution} is not installed as a package (run from a source tree?)",
            _REINSTALL,
        )
    missing: list[str] = []
    outdated: list[str] = []
    for text in dist.requires or []:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an optional extra, or another platform's dependency
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(str(requirement))
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            outdated.append(f"{requirement.name} {version} (needs {requirement.specifier})")
    versions = [f"{distribution} {dist.version}"]
    for name in shown:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    if missing or outdated:
        problems = [f"missing {name}" for name in missing] + outdated
        wanted = " ".join(f"'{r}'" for r in missing) or _REINSTALL
        hint = f"pip install {wanted}" if missing else _REINSTALL
        return Check("packages", "fail", "; ".join(problems), hint)
    return Check("packages", "ok", ", ".join(versions))


def home_check(home: BerthHome, *, uid: int | None = None) -> Check:
    """``$BERTH_HOME``: creatable, or a folder owned by ``uid`` (default: this process's
    user) that it can write and nobody else can (berth makes it mode 0700)."""
    uid = os.getuid() if uid is None else uid
    root = home.root
    try:
        info = root.stat()
    except FileNotFoundError:
        parent = _nearest_existing(root)
        if os.access(parent, os.W_OK | os.X_OK):
            return Check("home", "ok", f"{root} (created on first use)")
        return Check(
            "home",
            "fail",
            f"{root} does not exist and {parent} is not writable by {_user(uid)}",
            f"sudo install -d -m 700 -o {_user(uid)} {root}, or choose another --home",
        )
    except OSError as exc:
        return Check("home", "fail", f"{root}: {exc.strerror}", "choose another --home")
    if not stat.S_ISDIR(info.st_mode):
        return Check("home", "fail", f"{root} is not a folder", "choose another --home")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != uid:
        return Check(
            "home",
            "fail",
            f"{root} belongs to {_user(info.st_uid)}, not {_user(uid)}",
            f"sudo chown -R {_user(uid)} {root}",
        )
    if not os.access(root, os.W_OK | os.X_OK):
        return Check(
            "home", "fail", f"{root} is not writable (mode {mode:04o})", f"chmod 700 {root}"
        )
    if mode & 0o022:
        return Check(
            "home",
            "fail",
            f"{root} is writable by others (mode {mode:04o}): they could replace its keys",
            f"chmod 700 {root}",
        )
    if mode & 0o077:
        return Check(
            "home", "warn", f"{root} can be listed by others (mode {mode:04o})", f"chmod 700 {root}"
        )
    return Check("home", "ok", f"{root} (mode {mode:04o}, {_user(uid)})")


def secret_files(home: BerthHome) -> list[Path]:
    """The private files berth keeps under ``home``: the CA key, the leader's server keys,
    the API-key pepper, the agent's key."""
    return [
        home.ca_dir / CA_KEY_FILE,
        *(home.ca_dir / name for name in SERVER_KEY_FILES),
        home.pepper_file,
        home.agent_key,
    ]


def secrets_check(home: BerthHome, *, uid: int | None = None) -> Check:
    """Each private file that exists is owned by ``uid`` (default: this user) and neither
    readable nor writable by group or others (mode 0600), as ssh demands of its keys."""
    uid = os.getuid() if uid is None else uid
    present: list[str] = []
    problems: list[str] = []
    to_chmod: list[str] = []
    to_chown: list[str] = []
    for path in secret_files(home):
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror}")
            continue
        shown = str(path.relative_to(home.root))
        present.append(shown)
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid != uid:
            problems.append(f"{shown} belongs to {_user(info.st_uid)}")
            to_chown.append(str(path))
        if mode & 0o077:
            reach = "writable" if mode & 0o022 else "readable"
            problems.append(f"{shown} is {reach} by others (mode {mode:04o})")
            to_chmod.append(str(path))
    if problems:
        fixes = []
        if to_chown:
            fixes.append(f"sudo chown {_user(uid)} {' '.join(to_chown)}")
        if to_chmod:
            fixes.append(f"chmod 600 {' '.join(to_chmod)}")
        hint = " && ".join(fixes) or "check the files' permissions"
        return Check("secrets", "fail", "; ".join(problems), hint)
    if not present:
        return Check("secrets", "ok", "none yet (created mode 0600 when first needed)")
    return Check("secrets", "ok", f"{', '.join(present)}: private to {_user(uid)}")


def _nearest_existing(path: Path) -> Path:
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path("/")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
