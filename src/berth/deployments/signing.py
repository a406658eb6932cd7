"""The leader's side of signed specs: sign what the admin API or CLI accepted, carry the
signature with every start, and never start what the cluster did not sign.

- **First start** (:meth:`SpecSigning.sign_accepted`): a deployment :meth:`LifecycleManager.
  deploy` placed, i.e. one the admin API or the CLI accepted (through the socket's API), or
  one the leader made for such a request (an on-demand load or a replica of a configured
  service, a drain's replacement).  Once its model path on the node is known (a pull comes
  first), its spec is signed with the cluster's key and stored with the row
  (``deployments.signed_spec``), then sent.  This is the one place that signs.
- **Every later start** (:meth:`SpecSigning.for_restart`): the restart policy's, or another
  leader's after a failover.  The start is what the stored signed spec says, verified first
  against the cluster's keys; a row with no signature (written straight into the database,
  or made before signed specs) or one whose signature does not verify is refused with
  :class:`~berth.cluster.protocol.errors.SpecRefusedError`, which fails the deployment with
  the reason and a log line naming it.

The agent that runs the engine checks the same again (:func:`~berth.cluster.protocol.
spec_signing.check_signed`, in :class:`~berth.agent.core.AgentCore`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from berth.cluster.leader.agent_link import LOCAL_NODE_ID, AgentLink
from berth.cluster.pki.signing_key import SpecSigner
from berth.cluster.protocol.errors import SpecRefusedError
from berth.cluster.protocol.ops import SPEC_CAPABILITY
from berth.cluster.protocol.spec_signing import check_signed, request_of
from berth.store import Store
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.records import DeploymentRecord

log = logging.getLogger(__name__)


def is_spec_refusal(exc: BaseException) -> bool:
    """Whether a start failed because its spec was refused: here, by node ``local``'s core,
    or by a remote agent (whose ``spec_refused`` answer the link raises as
    :class:`SpecRefusedError`)."""
    return isinstance(exc, SpecRefusedError)


class SpecSigning:
    """Signs accepted specs with ``signer`` and checks stored ones (see the module doc)."""

    def __init__(
        self, store: Store, signer: SpecSigner, *, require_agent_check: bool = False
    ) -> None:
        self._store = store
        self._signer = signer
        self._require_agent_check = require_agent_check

    def check_node(self, link: AgentLink, deployment_id: str) -> None:
        """Refuse (:class:`SpecRefusedError`) a start on ``link``'s node when its agent does
        not check signed specs (a 0.1 agent: no ``spec.verify``) and the leader's
        ``require_agent_spec_check`` is on.  Node ``local``'s core always checks."""
        if link.node_id == LOCAL_NODE_ID or SPEC_CAPABILITY in link.capabilities:
            return
        if self._require_agent_check:
            raise SpecRefusedError(
                f"deployment {deployment_id}: node {link.node_id}'s agent does not check "
                "signed specs (an older agent, without spec.verify) and "
                "require_agent_spec_check is on; upgrade the agent",
                deployment_id=deployment_id,
            )
        log.warning("deployment %s: node %s's agent does not check signed specs; only this "
                    "leader's check guards the start", deployment_id, link.node_id)  # fmt: skip

    @property
    def signer(self) -> SpecSigner:
        return self._signer

    async def sign_accepted(self, request: DeploymentRequest) -> DeploymentRequest:
        """Sign the first start of a deployment the admin API or CLI accepted, store the
        signature with its row, and return ``request`` carrying it."""
        signed = self._signer.sign(request)
        await asyncio.to_thread(self._store.set_deployment_signature, request.deployment_id, signed)
        log.info("deployment %s: spec signed with %s", request.deployment_id, signed.key_id)
        return replace(request, signed=signed)

    def for_restart(self, record: DeploymentRecord) -> DeploymentRequest:
        """What a later start of ``record`` asks for: its signed spec, verified.  Raises
        :class:`SpecRefusedError` (logged) when it has none or it does not verify."""
        try:
            if record.signed_spec is None:
                raise SpecRefusedError(
                    f"deployment {record.id} has no spec signed by the cluster: it was not "
                    "deployed through the admin API or CLI (a row written straight into the "
                    "database, or one made before signed specs); not started. Deploy it "
                    "again through the API or CLI",
                    deployment_id=record.id,
                )
            request = request_of(record.signed_spec)
            if request.deployment_id != record.id:
                raise SpecRefusedError(
                    f"deployment {record.id} carries the signed spec of deployment "
                    f"{request.deployment_id}; not started",
                    deployment_id=record.id,
                )
            check_signed(request, self._signer.trusted)
        except SpecRefusedError as exc:
            log.error("refusing to start deployment %s: %s", record.id, exc)
            raise
        return request
