"""Backups of a leader's home: one ``tar.gz`` that brings a stopped leader back as it was.

A backup holds what the leader cannot rebuild and its agents and clients depend on:

- ``berth.db``: the state database (nodes and their certificate fingerprints, API key hashes,
  models, deployments), copied with SQLite's online backup API, so it is one consistent
  snapshot even while the daemon runs and writes; or ``berth.pgdump``, ``pg_dump``'s dump
  of a PostgreSQL ``database_url`` (:mod:`~berth.backup.postgres`);
- ``ca/``: the CA certificate and key, and the server certificates it issued (agents pin the
  CA's fingerprint; a new CA would make every agent re-enroll);
- ``key_pepper``: without it no stored API key or enrollment token hash matches;
- ``config.toml`` and ``adopted.yaml``, when present;
- ``manifest.json``, the first member: the format, the berth version, the database's schema
  version, when it was made, and each file's size, SHA-256 and mode.

Model files, logs and the daemon's runtime files are not included.  Every file a backup or
restore writes is mode 0600 (the archive holds the CA key and the pepper, and ``config.toml``
may hold the database password and ``cluster_secret``; the manifest names each secret it
carries: :mod:`~berth.backup.secrets`).  Reading one checks every member against the
manifest and refuses, with the reason, an archive that is truncated, corrupt, has a member the
manifest does not list or a path that is absolute or climbs out with ``..``.

Modules: :mod:`~berth.backup.manifest` (the archive format), :mod:`~berth.backup.archive`
(writing and verifying archives), :mod:`~berth.backup.database` (the SQLite snapshot),
:mod:`~berth.backup.postgres` (the PostgreSQL dump), :mod:`~berth.backup.secrets`,
:mod:`~berth.backup.target` (what a restore must find before it overwrites a database: no
live leader, and the lease epoch to stay above), :mod:`~berth.backup.create` and
:mod:`~berth.backup.restore`.
"""

from berth.backup.archive import verify_backup
from berth.backup.create import create_backup
from berth.backup.database import snapshot_database, sqlite_database_path
from berth.backup.manifest import (
    DATABASE_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    OPTIONAL_FILES,
    PEPPER_NAME,
    BackupFile,
    BackupManifest,
    member_refusal,
)
from berth.backup.restore import RestoreReport, restore_backup, running_daemon

__all__ = [
    "DATABASE_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "OPTIONAL_FILES",
    "PEPPER_NAME",
    "BackupFile",
    "BackupManifest",
    "RestoreReport",
    "create_backup",
    "member_refusal",
    "restore_backup",
    "running_daemon",
    "snapshot_database",
    "sqlite_database_path",
    "verify_backup",
]
