"""The desk worker's files under ``$BERTH_HOME/desk/`` (folder 0700, files 0600).

- ``nodes.json``: the pool the nodes belong to and, per registered model, its node secret,
  public code, price and when its last pool test was accepted::

      {"pool_url": "https://owterminal.com",
       "nodes": [{"model": "smollm2", "secret": "sk-node-...", "code": "N-7QX2",
                  "price": 150, "price_basis": "host", "registered_at": 1718000000.0,
                  "check_accepted_at": null}]}

- ``enckey.json``: the host's X25519 key pair, raw keys in unpadded base64url::

      {"private_key": "...", "public_key": "..."}

Both are written with :mod:`berth.atomic` (a temporary file created 0600 in the same
folder, then renamed; ``enckey.json`` only created, never replaced), so a reader never sees
half a file and the secrets are never readable by others, not even for a moment. A
malformed file raises :class:`~berth.errors.ConfigError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from berth.atomic import create_atomic, write_atomic
from berth.desk.sealing import HostKeyPair, b64url_decode, b64url_encode
from berth.desk.wire import is_node_secret
from berth.errors import ConfigError
from berth.paths import BerthHome


@dataclass(frozen=True)
class DeskFiles:
    """Where the desk worker keeps its state in one home."""

    home: BerthHome

    @property
    def folder(self) -> Path:
        return self.home.root / "desk"

    @property
    def nodes_file(self) -> Path:
        return self.folder / "nodes.json"

    @property
    def key_file(self) -> Path:
        return self.folder / "enckey.json"

    @property
    def log_file(self) -> Path:
        """``berth desk serve``'s log (job ids, models, token counts: never a prompt)."""
        return self.home.logs_dir / "desk.log"


class RegisteredNode(msgspec.Struct):
    """One model registered with the desk as a node (times in seconds since the epoch)."""

    model: str
    secret: str
    code: str
    price: int | None = None
    price_basis: str | None = None
    registered_at: float = 0.0
    check_accepted_at: float | None = None


class NodeBook(msgspec.Struct):
    """The content of ``nodes.json``: the pool and its nodes, in registration order."""

    pool_url: str | None = None
    nodes: list[RegisteredNode] = msgspec.field(default_factory=list)

    def find(self, model: str) -> RegisteredNode | None:
        """The node registered for ``model``, or ``None``."""
        return next((node for node in self.nodes if node.model == model), None)

    @property
    def machine_secret(self) -> str | None:
        """The secret that groups a new registration with this machine (the first node's)."""
        return self.nodes[0].secret if self.nodes else None


class _KeyFile(msgspec.Struct):
    private_key: str
    public_key: str


def _write_private(path: Path, data: bytes, *, create_only: bool = False) -> bool:
    """Replace (or, with ``create_only``, create) ``path`` atomically, mode 0600 from the
    first byte, the folder created 0700 when missing; whether the file was written. Raises
    :class:`ConfigError` naming the file when it cannot be written."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if create_only:
            return create_atomic(path, data, mode=0o600)
        write_atomic(path, data, mode=0o600)
    except OSError as exc:
        raise ConfigError(f"cannot write it: {exc.strerror}", path=path) from None
    return True


def load_nodes(files: DeskFiles) -> NodeBook:
    """``nodes.json``, or an empty book when it does not exist yet.

    Raises :class:`ConfigError` naming the file when it is not the shape above or holds a
    secret that is not a node secret.
    """
    try:
        raw = files.nodes_file.read_bytes()
    except FileNotFoundError:
        return NodeBook()
    except OSError as exc:
        raise ConfigError(f"cannot read it: {exc.strerror}", path=files.nodes_file) from None
    try:
        book = msgspec.json.decode(raw, type=NodeBook)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"malformed node file: {exc}", path=files.nodes_file) from None
    for node in book.nodes:
        if not is_node_secret(node.secret):
            raise ConfigError(
                f"the secret of {node.model!r} is not a node secret", path=files.nodes_file
            )
    return book


def save_nodes(files: DeskFiles, book: NodeBook) -> None:
    """Write ``book`` to ``nodes.json`` (atomically, 0600)."""
    _write_private(files.nodes_file, msgspec.json.format(msgspec.json.encode(book)) + b"\n")


def load_key_pair(files: DeskFiles) -> HostKeyPair | None:
    """The host key pair from ``enckey.json``, or ``None`` when there is none yet.

    Raises :class:`ConfigError` naming the file when it is malformed, a key is not
    base64url of 32 bytes, or the public key does not belong to the private one.
    """
    try:
        raw = files.key_file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read it: {exc.strerror}", path=files.key_file) from None
    try:
        stored = msgspec.json.decode(raw, type=_KeyFile)
        keys = HostKeyPair.from_private(b64url_decode(stored.private_key))
        public_raw = b64url_decode(stored.public_key)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ConfigError(f"malformed key file: {exc}", path=files.key_file) from None
    if public_raw != keys.public_raw:
        raise ConfigError("the public key does not match the private key", path=files.key_file)
    return keys


def load_or_create_key_pair(files: DeskFiles) -> HostKeyPair:
    """The host key pair, generated and saved (0600) the first time; when two processes
    create it at once, both end up with the one that was written first."""
    keys = load_key_pair(files)
    if keys is not None:
        return keys
    keys = HostKeyPair.generate()
    stored = _KeyFile(private_key=b64url_encode(keys.private_raw), public_key=keys.public_b64)
    if _write_private(files.key_file, msgspec.json.encode(stored) + b"\n", create_only=True):
        return keys
    found = load_key_pair(files)
    assert found is not None, "enckey.json vanished right after it was created"
    return found


def record_check_accepted(files: DeskFiles, model: str, at: float) -> None:
    """Note in ``nodes.json`` that ``model``'s pool test was accepted at ``at`` (seconds
    since the epoch). The file is read again first, so a concurrent change is kept."""
    book = load_nodes(files)
    node = book.find(model)
    if node is not None:
        node.check_accepted_at = at
        save_nodes(files, book)
