"""The direct data path's identities and their wire contract, without sockets: the leader's
client certificate, an agent's ingress certificate, Hello's optional ``advertise``, and
what ``/admin/nodes`` says of a node's path."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from berth.admin.nodes import LOCAL_PATH, node_detail_view, node_summary_view
from berth.cluster.leader.direct_path import DataPath
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.direct_tls import (
    LEADER_URI,
    check_ingress_certificate,
    check_leader_certificate,
    ensure_leader_certificate,
    ingress_server_context,
    ingress_server_name,
    issue_ingress_certificate,
    leader_client_context,
)
from berth.cluster.protocol.direct import parse_address, split_deployment_target
from berth.cluster.protocol.frames import Hello, decode_frame, encode_frame
from berth.cluster.protocol.payloads import Inventory
from berth.errors import AuthError
from berth.vocab.records import NodeHardware, NodeRecord
from support.direct import NODE_ID, make_pki


def test_the_leaders_certificate_is_issued_once_and_names_the_leader(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    cert_path, key_path = ensure_leader_certificate(ca, tmp_path / "ca")
    first = cert_path.read_bytes()

    assert ensure_leader_certificate(ca, tmp_path / "ca") == (cert_path, key_path)
    assert cert_path.read_bytes() == first  # still good: kept
    assert key_path.stat().st_mode & 0o777 == 0o600
    leaf = check_leader_certificate(first, ca.certificate)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [LEADER_URI]

    other = CertificateAuthority.load_or_create(tmp_path / "other")
    ensure_leader_certificate(other, tmp_path / "ca")  # a CA that did not issue it: renewed
    assert cert_path.read_bytes() != first
    check_leader_certificate(cert_path.read_bytes(), other.certificate)


def test_an_ingress_certificate_is_for_the_agents_own_key_and_names_only_its_node(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path)
    pem = issue_ingress_certificate(pki.ca, pki.agent_cert_der, NODE_ID)

    leaf = check_ingress_certificate(pem, pki.ca.certificate, NODE_ID)
    agent = x509.load_der_x509_certificate(pki.agent_cert_der)
    assert leaf.public_key() == agent.public_key()
    usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [ingress_server_name(NODE_ID)]
    assert ingress_server_name(NODE_ID) == f"{NODE_ID}.node.berth.invalid"
    assert leaf.not_valid_after_utc > datetime.now(UTC)
    with pytest.raises(AuthError, match="does not name node"):
        check_ingress_certificate(pem, pki.ca.certificate, "n-00000000")
    with pytest.raises(AuthError, match="not a client certificate"):
        check_leader_certificate(pem, pki.ca.certificate)  # a server certificate


def test_every_root_of_a_trust_bundle_is_read_a_leaf_under_the_second_passes(
    tmp_path: Path,
) -> None:
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    bundle = [old.ca.certificate, new.ca.certificate]  # a rotation: old root first
    ingress = issue_ingress_certificate(new.ca, new.agent_cert_der, NODE_ID)
    leader = new.leader_cert.read_bytes()

    assert check_ingress_certificate(ingress, bundle, NODE_ID).issuer == new.ca.certificate.subject
    check_leader_certificate(leader, bundle)
    with pytest.raises(AuthError, match="not issued by the berth CA"):
        check_ingress_certificate(ingress, [old.ca.certificate], NODE_ID)  # that root only
    with pytest.raises(AuthError, match="not issued by the berth CA"):
        check_leader_certificate(leader, bundle[:1])


async def test_the_leaders_client_context_trusts_every_root_of_its_bundle(tmp_path: Path) -> None:
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    cert_path = tmp_path / "ingress.pem"
    cert_path.write_bytes(issue_ingress_certificate(new.ca, new.agent_cert_der, NODE_ID))
    server = ingress_server_context(cert_path, new.agent_key, new.leader_cert.read_bytes())
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def accepted(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()
        done.set_result(None)

    listening = await asyncio.start_server(accepted, "127.0.0.1", 0, ssl=server)
    port = listening.sockets[0].getsockname()[1]
    bundle_pem = old.ca.cert_pem + new.ca.cert_pem  # the new CA second
    client = leader_client_context(bundle_pem, new.leader_cert, new.leader_key)
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname=ingress_server_name(NODE_ID)
        )
        await asyncio.wait_for(done, 10)  # both ends verified each other
        writer.close()
    finally:
        listening.close()
        await listening.wait_closed()


def test_hello_without_advertise_is_an_agent_without_a_direct_path() -> None:
    inventory = Inventory(hostname="h")
    old = Hello(protocol_min=1, protocol_max=1, agent_version="0.0.9", inventory=inventory)
    assert b"advertise" not in encode_frame(old)  # an empty field is left off the wire
    assert msgspec.structs.replace(old, advertise="") == decode_frame(encode_frame(old))
    new = msgspec.structs.replace(old, advertise="10.0.0.7:11502")
    decoded = decode_frame(encode_frame(new))
    assert isinstance(decoded, Hello) and decoded.advertise == "10.0.0.7:11502"


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("10.0.0.7:11502", ("10.0.0.7", 11502)),
        ("gpu-a.lan:443", ("gpu-a.lan", 443)),
        ("[2001:db8::7]:11502", ("2001:db8::7", 11502)),
        ("10.0.0.7", None),
        ("10.0.0.7:0", None),
        (":11502", None),
        ("10.0.0.7:http", None),
    ],
)
def test_advertised_addresses(text: str, address: tuple[str, int] | None) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize(
    ("path", "split"),
    [
        (b"/d/d-1a2b3c4d/v1/chat/completions", ("d-1a2b3c4d", b"/v1/chat/completions")),
        (b"/d/d-1a2b3c4d/v2/x", None),
        (b"/d//v1/x", None),
        (b"/v1/chat/completions", None),
    ],
)
def test_ingress_paths(path: bytes, split: tuple[str, bytes] | None) -> None:
    assert split_deployment_target(path) == split


def _record(node_id: str) -> NodeRecord:
    hardware = NodeHardware("h", 16, 64000, ())
    created = datetime(2025, 3, 4, tzinfo=UTC)
    return NodeRecord(node_id, "gpu-a", "ready", "sha256:ab", "0.1.0", 1, (), hardware, 1.0,
                      created)  # fmt: skip


def test_the_admin_api_says_which_path_and_why() -> None:
    path = DataPath("tunnel", "its ingress did not answer a probe", "10.0.0.7:11502", 12.5)

    summary = node_summary_view(_record(NODE_ID), connected=True, path=path)
    detail = node_detail_view(_record(NODE_ID), connected=True, path=path)
    local = node_summary_view(_record("local"), connected=True, path=LOCAL_PATH)
    gone = node_detail_view(_record(NODE_ID), connected=False)

    assert (summary.data_path, summary.data_path_reason) == ("tunnel", path.reason)
    assert (detail.advertised_address, detail.data_path_since) == ("10.0.0.7:11502", 12.5)
    assert local.data_path == "local"
    assert (gone.data_path, gone.data_path_reason, gone.advertised_address) == (None, None, None)
