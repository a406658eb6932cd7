"""``berth backup create|restore|verify``: a leader's state in one archive, and back."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from berth.backup import BackupManifest, create_backup, restore_backup, verify_backup
from berth.backup.restore import database_elsewhere_note
from berth.cli.common import console, context, print_json
from berth.cli.context import HELP_OPTIONS
from berth.config import Settings
from berth.paths import resolve_home

backup_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Back up a leader's state (database, CA, key pepper, config) and restore it.",
    no_args_is_help=True,
)


def _size(size_bytes: int) -> str:
    for unit, scale in (("MiB", 1024 * 1024), ("KiB", 1024)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes} B"


def _manifest_json(manifest: BackupManifest) -> dict[str, object]:
    return {
        "format_version": manifest.format_version,
        "berth_version": manifest.berth_version,
        "schema_version": manifest.schema_version,
        "created_at": manifest.created_at,
        "files": [
            {"name": f.name, "size_bytes": f.size_bytes, "sha256": f.sha256, "mode": f"{f.mode:o}"}
            for f in manifest.files
        ],
        "secrets": list(manifest.secrets),
    }


def _print_manifest(manifest: BackupManifest) -> None:
    console.print(
        f"  made by berth {manifest.berth_version} at {manifest.created_at}, "
        f"database schema version {manifest.schema_version}"
    )
    table = Table("FILE", "SIZE", "MODE", "SHA-256", box=None, pad_edge=False)
    for entry in manifest.files:
        table.add_row(entry.name, _size(entry.size_bytes), f"{entry.mode:o}", entry.sha256[:16])
    console.print(table)


def _berth(home: Path) -> str:
    """How to call berth for this home in printed advice."""
    return "berth" if home == resolve_home() else f"berth --home {home}"


@backup_app.command("create")
def create(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help="The archive to write, e.g. berth-backup.tar.gz."),
    force: bool = typer.Option(False, "--force", help="Replace FILE if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Write a consistent snapshot of this leader (safe while the daemon runs).

    The archive holds the database (SQLite's online backup, or pg_dump), ca/ (the CA and
    its certificates), the key pepper and config.toml; it is written with mode 0600, and
    names every secret it carries (keys, pepper, a database password or cluster_secret in
    config.toml).
    """
    home = context(ctx).home
    settings = Settings.load(home)
    manifest = create_backup(home, settings.database_url, file, force=force)
    if as_json:
        print_json({"file": str(file.expanduser().absolute()), **_manifest_json(manifest)})
        return
    console.print(
        f"[bold green]backup written[/] {escape(str(file))} ({len(manifest.files)} files, "
        f"{_size(manifest.size_bytes)} before compression, mode 600)",
        soft_wrap=True,
        markup=True,
    )
    _print_manifest(manifest)
    console.print(
        f"It holds secrets: {'; '.join(manifest.secrets)}. Keep it as safe as the leader.",
        soft_wrap=True,
        markup=False,
        style="yellow",
    )


@backup_app.command("restore")
def restore(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help="An archive written by berth backup create."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace the state this home and its database hold (moved or dumped aside, not "
        "lost). Never overrides the refusal of a database a live leader uses.",
    ),
) -> None:
    """Bring a stopped leader back from a backup; its agents reconnect without re-enrolling.

    Refused while any leader holds or renewed the lease of the database it would overwrite
    within the last 3 leases, with or without --force. The restored lease's epoch is above
    every epoch that database had seen, so no leader of the old state passes the fence.
    """
    home = context(ctx).home
    report = restore_backup(home, file, force=force)
    console.print(
        f"[bold green]restored[/] {escape(str(home.root))} from {escape(str(file))}",
        soft_wrap=True,
        markup=True,
    )
    _print_manifest(report.manifest)
    console.print(f"  database  {report.database_url or report.database_path}", soft_wrap=True)
    if report.lease_epoch is not None:
        had = f"the {report.previous_epoch} the database had" if report.previous_epoch else "it"
        console.print(
            f"  lease     epoch {report.lease_epoch}, expired (above {had} and the backup's: "
            f"the next leader to start takes {report.lease_epoch + 1})",
            soft_wrap=True,
            markup=False,
        )
    if report.replaced_dir is not None:
        console.print(f"  the state it replaced is in {report.replaced_dir}", soft_wrap=True)
    note = database_elsewhere_note(report.database_url, Settings.load(home, env={}).database_url)
    if note is not None:
        console.print(note, soft_wrap=True, markup=False, style="yellow")
    settings = Settings.load(home)
    console.print(
        f"next: {_berth(home.root)} daemon start   (agents dial {settings.cluster_url()}: start "
        "the leader where that name and port reach it, and they reconnect on their own)",
        soft_wrap=True,
        markup=False,
    )


@backup_app.command("verify")
def verify(
    file: Path = typer.Argument(..., help="An archive written by berth backup create."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Check every file of a backup against its manifest, without restoring anything."""
    manifest = verify_backup(file)
    if as_json:
        print_json(_manifest_json(manifest))
        return
    console.print(
        f"[bold green]ok[/] {escape(str(file))}: every file matches its checksum",
        soft_wrap=True,
        markup=True,
    )
    _print_manifest(manifest)
