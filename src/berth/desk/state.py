"""The desk worker's files under ``$BERTH_HOME/desk/`` (folder 0700, files 0600).

- ``nodes.json``: the pool the nodes belong to and, per registered model, its node secret,
  public code, price and when its last pool test was accepted::

      {"pool_url": "https://owterminal.com",
       "nodes": [{"model": "smollm2", "secret": "sk-node-...", "code": "N-7QX2",
                  "price": 150, "price_basis": "host", "registered_at": 1718000000.0,
                  "check_accepted_at": null}]}

- ``enckey.json``: the host's X25519 key pair, raw keys in unpadded base64url::

      {"private_key": "...", "public_key": "..."}

Both are replaced atomically (a temporary file created 0600 in the same folder, then
renamed), so a reader never sees half a file and the secrets are never readable by others,
not even for a moment. A malformed file raises :class:`~berth.errors.ConfigError` naming it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec

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


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, mode 0600 from the first byte; the folder
    is created 0700 when missing."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)  # 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


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
    write_private(files.nodes_file, msgspec.json.format(msgspec.json.encode(book)) + b"\n")


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
    """The host key pair, generated and saved (0600) the first time."""
    keys = load_key_pair(files)
    if keys is None:
        keys = HostKeyPair.generate()
        stored = _KeyFile(private_key=b64url_encode(keys.private_raw), public_key=keys.public_b64)
        write_private(files.key_file, msgspec.json.encode(stored) + b"\n")
    return keys


def record_check_accepted(files: DeskFiles, model: str, at: float) -> None:
    """Note in ``nodes.json`` that ``model``'s pool test was accepted at ``at`` (seconds
    since the epoch). The file is read again first, so a concurrent change is kept."""
    book = load_nodes(files)
    node = book.find(model)
    if node is not None:
        node.check_accepted_at = at
        save_nodes(files, book)
