"""Replacing the cluster CA without stopping the cluster: rotate, watch, retire.

``berth ca rotate`` (:func:`rotate`) makes a new CA key and certificate; the old root and
its key stay, as ``ca-previous.pem`` and ``ca-previous.key``.  While both are there:

- every new agent leaf is issued under the new CA: agents get theirs at their next renewal,
  with the trust bundle (both roots) that the renewal answer carries, and a node enrolled
  meanwhile gets the bundle in its registration answer;
- the cluster listener trusts leaves of either root, so an agent that was offline during
  the rotation dials in with its old leaf and renews, as long as that leaf is valid;
- the leader's own server certificates stay issued by the old root, which every agent
  trusts (enrollment URIs pin it too); the listeners serve them from their files;
- ``berth ca status`` (:func:`holders_of_old_leaves`) names the nodes whose current
  certificate the old CA issued;
- the spec signing key (:mod:`berth.cluster.pki.signing_key`) rotates with the CA: the new key
  signs, the old one is still trusted, agents get both at renewal, and the stored
  signatures are signed again with the new key (``POST /admin/ca/rotate``).  Retiring the
  CA retires the old signing key too.

``berth ca retire`` (:func:`retire`) removes the old root and key and issues the server
certificates again under the new CA, which by then every node trusts: it is refused while a
node still holds an old-CA leaf (that node never received the new root), unless forced.
The listeners pick the new server certificates up from their files
(:mod:`berth.http_server.tls_reload`).

Each file is replaced atomically; the new CA pair is written aside (``*.next``) and moved
into place when the CA loads (:meth:`CertificateAuthority.load_or_create`), key first, so
a crash part way leaves a CA that loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from berth.atomic import write_atomic
from berth.cluster.pki import ca as ca_files
from berth.cluster.pki import signing_key
from berth.cluster.pki.ca import (
    CA_CERT_FILE,
    CA_KEY_FILE,
    PREVIOUS_CERT_FILE,
    PREVIOUS_KEY_FILE,
    CertificateAuthority,
    next_path,
)
from berth.errors import ConflictError
from berth.store import Store

#: The leader's own server certificates under the CA folder, issued again at each step.
SERVER_PAIRS = (("public.pem", "public.key"), ("cluster.pem", "cluster.key"))


@dataclass(frozen=True)
class OldLeaf:
    """A node whose current certificate the current CA did not issue (``issuer``: the
    issuer's fingerprint; ``None``: issued before berth recorded certificates)."""

    node_id: str
    label: str
    issuer: str | None


def rotate(ca: CertificateAuthority) -> None:
    """Make a new CA in ``ca``'s folder (see the module docstring) and reload ``ca``.

    Raises :class:`ConflictError` while a rotation is already under way (retire first).
    """
    if ca.previous is not None:
        raise ConflictError(
            "a CA rotation is already under way; retire the old root first (berth ca retire)"
        )
    folder = ca.ca_dir
    pem = ca_files._PEM
    old_key_pem = (folder / CA_KEY_FILE).read_bytes()
    new_key = ec.generate_private_key(ec.SECP256R1())
    new_cert = ca_files._self_signed(new_key)
    write_atomic(folder / PREVIOUS_KEY_FILE, old_key_pem, mode=0o600)
    write_atomic(folder / PREVIOUS_CERT_FILE, ca.certificate.public_bytes(pem), mode=0o644)
    write_atomic(next_path(folder / CA_KEY_FILE), ca_files._private_pem(new_key), mode=0o600)
    write_atomic(next_path(folder / CA_CERT_FILE), new_cert.public_bytes(pem), mode=0o644)
    ca.reload()  # moves the new pair into place
    signing_key.rotate(folder)  # the spec signing key rotates with the CA
    # Still under the old root, but written anew: the listeners reload on the change and
    # their trust stores then hold both roots (agents' new leaves come from the new one).
    reissue_server_certificates(ca)


def retire(ca: CertificateAuthority, holders: list[OldLeaf], *, force: bool = False) -> None:
    """Remove the old root once no node holds a leaf it issued (``holders``: from
    :func:`holders_of_old_leaves`), reload ``ca`` and issue the server certificates anew.

    Raises :class:`ConflictError` when no rotation is under way, or when ``holders`` is not
    empty and ``force`` is not given (naming them).
    """
    if ca.previous is None:
        raise ConflictError("no CA rotation is under way: there is no old root to retire")
    if holders and not force:
        names = ", ".join(f"{h.label} ({h.node_id})" for h in holders)
        raise ConflictError(
            f"nodes still hold certificates of the old CA: {names}; they move to the new CA "
            "at their next renewal (or retire with --force and enroll them again)"
        )
    for name in (PREVIOUS_CERT_FILE, PREVIOUS_KEY_FILE):
        (ca.ca_dir / name).unlink(missing_ok=True)
    signing_key.retire(ca.ca_dir)
    ca.reload()
    reissue_server_certificates(ca)


def holders_of_old_leaves(store: Store, ca: CertificateAuthority) -> list[OldLeaf]:
    """The enrolled nodes (not removed, not ``local``) whose current certificate the
    current CA did not issue, by label."""
    current = store.current_node_certificates()
    holders = []
    for node in store.list_nodes():
        if node.cert_fingerprint is None:
            continue  # node local
        issued = current.get(node.id)
        issuer = issued.issuer_fingerprint if issued is not None else None
        if issuer != ca.fingerprint_sha256:
            holders.append(OldLeaf(node.id, node.label, issuer))
    return holders


def reissue_server_certificates(ca: CertificateAuthority) -> None:
    """Issue the leader's own server certificates in the CA folder again, for the names
    they have (a pair that is missing or unreadable is left alone)."""
    for cert_name, key_name in SERVER_PAIRS:
        cert_path = ca.ca_dir / cert_name
        try:
            leaf = x509.load_pem_x509_certificate(cert_path.read_bytes())
            sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (OSError, ValueError, x509.ExtensionNotFound):
            continue
        names: list[str] = list(sans.get_values_for_type(x509.DNSName))
        names += [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
        ca.issue_server_certificate(names, cert_path, ca.ca_dir / key_name)
