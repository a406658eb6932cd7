"""``berth desk register``, ``status``, ``check`` and ``link``: one call each, as the CLI runs
them (``berth.cli.desk_cmd`` prints the results).

Which pool: the ``desk_pool_url`` setting (``--pool-url``, ``BERTH_DESK_POOL_URL``,
``[desk] desk_pool_url`` in ``config.toml``), else the pool the nodes in ``nodes.json`` were
registered with, else ``https://owterminal.com``. Node secrets belong to one pool, so a
setting that names another pool than ``nodes.json`` is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from berth.config import Settings
from berth.desk.client import DeskClient
from berth.desk.errors import DeskError
from berth.desk.leader import Leader
from berth.desk.state import (
    DeskFiles,
    NodeBook,
    RegisteredNode,
    load_nodes,
    load_or_create_key_pair,
    record_check_accepted,
    save_nodes,
)
from berth.desk.wire import (
    MODEL_ID_PATTERN,
    PRICE_MAX_CENTS,
    PRICE_MIN_CENTS,
    LinkCode,
    NodeStatus,
    RegisterRequest,
    is_model_id,
)
from berth.errors import ConfigError, NotFoundError
from berth.paths import BerthHome


def resolve_pool_url(home: BerthHome, flag: str | None) -> str:
    """The pool to talk to (see the module docstring), without a trailing ``/``.

    Raises :class:`ConfigError` for an invalid URL (naming where it came from) or one that
    is not the pool the registered nodes belong to.
    """
    settings = Settings.load(home, flags={"desk_pool_url": flag})
    url = settings.desk_pool_url.rstrip("/")
    source = settings.source("desk_pool_url")
    book = load_nodes(DeskFiles(home))
    if book.pool_url is None or not book.nodes:
        return url
    if source == "default":
        return book.pool_url
    if url != book.pool_url:
        raise ConfigError(
            f"the models in {DeskFiles(home).nodes_file} are registered with {book.pool_url}, "
            f"not {url} (desk_pool_url, from {source}); their secrets work only there"
        )
    return url


def pick_nodes(book: NodeBook, models: Sequence[str]) -> list[RegisteredNode]:
    """The registered nodes of ``models`` (all of them when empty).

    Raises :class:`ConfigError` when nothing is registered and :class:`NotFoundError` for a
    model that is not.
    """
    if not book.nodes:
        raise ConfigError("no model is registered with the desk yet; run: berth desk register")
    if not models:
        return list(book.nodes)
    picked = []
    for model in models:
        node = book.find(model)
        if node is None:
            raise NotFoundError("registered desk model", model)
        picked.append(node)
    return picked


@dataclass(frozen=True)
class Registration:
    """One model's registration: new, or found in ``nodes.json`` (``already``)."""

    node: RegisteredNode
    already: bool


async def register_models(
    *,
    files: DeskFiles,
    leader: Leader,
    desk: DeskClient,
    models: Sequence[str],
    price: int | None,
    warn: Callable[[str], None],
    now: Callable[[], float],
) -> list[Registration]:
    """Register ``models`` (every served model when empty) with ``desk`` as one machine.

    The first registration goes without ``machineSecret``, every later one (now or in an
    earlier run) with the first node's secret. The host key pair is created the first
    time. ``nodes.json`` is written after each registration, so a failure part-way keeps
    what the desk already gave. A served name that is not a valid desk model id is skipped
    with ``warn`` naming it.

    Raises :class:`ConfigError` for a price outside 1..5000, a named model that is not a
    valid id or not served, or a leader serving nothing; a :class:`DeskError` from the desk.
    """
    if price is not None and not PRICE_MIN_CENTS <= price <= PRICE_MAX_CENTS:
        raise ConfigError(
            f"--price {price}: a price is {PRICE_MIN_CENTS} to {PRICE_MAX_CENTS} cents "
            "per million tokens"
        )
    served = await leader.served_models()
    for name in models:
        if not is_model_id(name):
            raise ConfigError(f"{name!r} is not a valid desk model id ({MODEL_ID_PATTERN.pattern})")
        if name not in served:
            listed = ", ".join(served) or "none"
            raise ConfigError(
                f"model {name!r} is not served by this leader (served: {listed}); "
                f"start it first, e.g. berth run {name}"
            )
    targets = list(dict.fromkeys(models))
    if not targets:
        for name in served:
            if is_model_id(name):
                targets.append(name)
            else:
                warn(
                    f"served model {name!r} is not a valid desk model id "
                    f"({MODEL_ID_PATTERN.pattern}); skipped"
                )
        if not targets:
            raise ConfigError("the leader serves no model to offer; start one with berth run")
    keys = load_or_create_key_pair(files)
    book = load_nodes(files)
    book.pool_url = desk.pool_url
    done: list[Registration] = []
    for model in targets:
        existing = book.find(model)
        if existing is not None:
            done.append(Registration(existing, already=True))
            continue
        answer = await desk.register(
            RegisterRequest(
                model=model,
                enc_pubkey=keys.public_b64,
                price=price,
                machine_secret=book.machine_secret,
            )
        )
        node = RegisteredNode(
            model=model,
            secret=answer.secret,
            code=answer.code,
            price=answer.price,
            price_basis=answer.price_basis,
            registered_at=now(),
        )
        book.nodes.append(node)
        save_nodes(files, book)
        done.append(Registration(node, already=False))
    return done


@dataclass(frozen=True)
class NodeReport:
    """One node's answer to ``status`` or ``check``: the answer, or why there is none."""

    node: RegisteredNode
    status: NodeStatus | None = None
    check_result: str | None = None
    error: DeskError | None = None


async def node_statuses(desk: DeskClient, nodes: Sequence[RegisteredNode]) -> list[NodeReport]:
    """``GET /api/v1/node/status`` for each of ``nodes``; a node the desk refuses or does
    not answer for carries the error instead."""
    reports = []
    for node in nodes:
        try:
            reports.append(NodeReport(node, status=await desk.status(node.secret)))
        except DeskError as exc:
            reports.append(NodeReport(node, error=exc))
    return reports


async def request_checks(
    desk: DeskClient, files: DeskFiles, nodes: Sequence[RegisteredNode], now: Callable[[], float]
) -> list[NodeReport]:
    """Ask for a pool test of each of ``nodes`` (``POST /api/v1/node/check``, noted in
    ``nodes.json`` when accepted), then read its result (``GET``) as the desk writes it.
    The pool test itself runs once ``berth desk serve`` claims the desk's ``check_`` job."""
    reports = []
    for node in nodes:
        try:
            await desk.request_check(node.secret)
            record_check_accepted(files, node.model, now())
            reports.append(NodeReport(node, check_result=await desk.check_result(node.secret)))
        except DeskError as exc:
            reports.append(NodeReport(node, error=exc))
    return reports


async def link_machine(desk: DeskClient, book: NodeBook) -> LinkCode:
    """A one-time code that links this machine (all its nodes) to an account on the desk.

    Raises :class:`ConfigError` when no model is registered yet, a :class:`DeskError` from
    the desk.
    """
    secret = book.machine_secret
    if secret is None:
        raise ConfigError("no model is registered with the desk yet; run: berth desk register")
    return await desk.link(secret)
