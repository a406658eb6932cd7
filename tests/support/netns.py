"""Agents in network namespaces of their own, for tests and benchmarks that cut or kill
things between a leader and its nodes.

:class:`Namespaces` makes one bridge in the root namespace, holding the host's address
(``SUBNET.1``), and for each label a namespace with one end of a veth pair (``SUBNET.2``,
``SUBNET.3``, ...), the other end on the bridge. Leaders stay in the root namespace and bind
their cluster listener on the bridge's address; an agent started with
:meth:`Namespaces.start_agent` dials it across its veth, and its engines listen on the
namespace's own loopback. Every name carries ``prefix``, so two users with different
prefixes and subnets never touch each other's: :meth:`Namespaces.unique` picks both for a test
that runs beside others.

Needs root and ``ip`` (iptables too where a caller cuts links): :meth:`Namespaces.why_not`
says why not, else ``None``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from support.cluster_harness import Agent, Cluster


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (30 s at most); ``CalledProcessError`` when ``check`` and it fails."""
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class Namespaces:
    """``labels``' namespaces on one bridge; ``subnet`` is a /24's first three octets."""

    prefix: str
    subnet: str
    labels: tuple[str, ...]

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def host_ip(self) -> str:
        """The bridge's address in the root namespace: where leaders listen for agents."""
        return f"{self.subnet}.1"

    def namespace(self, label: str) -> str:
        return f"{self.prefix}-{label}"

    def veth(self, label: str) -> tuple[str, str]:
        """(the root end on the bridge, the end inside the namespace)."""
        return f"{self.prefix}-{label}", f"{self.prefix}-{label}-ns"

    @classmethod
    def unique(cls, name: str, network: str, labels: tuple[str, ...]) -> Namespaces:
        """Namespaces that no other process uses now, for tests that run beside others
        (pytest-xdist workers, another checkout's run): the prefix is ``name`` and this
        process's pid in hex (``name`` of 2-3 letters keeps every interface name within
        Linux's 15 bytes), and the subnet is a ``network.X`` /24 (``network`` holds two
        octets) that no interface of the root namespace has an address in, X drawn at random.

        Call it when the namespaces are about to be made (a fixture), not at import: every
        worker imports every module.
        """
        listed = run("ip", "-o", "-4", "addr", "show").stdout
        taken = {int(found) for found in re.findall(rf"inet {re.escape(network)}\.(\d+)\.", listed)}
        free = [third for third in range(1, 255) if third not in taken]
        if not free:
            raise RuntimeError(f"every /24 in {network}.0.0/16 is taken on this host")
        return cls(f"{name}{os.getpid():x}", f"{network}.{random.choice(free)}", labels)

    def why_not(self, *, iptables: bool = False) -> str | None:
        """Why namespaces cannot be made here (with ``iptables`` working inside them when
        asked), or ``None``."""
        if sys.platform != "linux" or os.geteuid() != 0:
            return "network namespaces need root on Linux"
        for tool in ("ip", "iptables") if iptables else ("ip",):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        probe = f"{self.prefix}-probe"
        made = run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` does not work here: {made.stderr.strip()}"
        try:
            if iptables:
                rule = run("ip", "netns", "exec", probe, "iptables", "-L", "-n", check=False)
                if rule.returncode != 0:
                    return f"iptables does not work in a namespace: {rule.stderr.strip()}"
        finally:
            run("ip", "netns", "del", probe, check=False)
        return None

    def teardown(self) -> None:
        """Remove the namespaces, veths and bridge (those that exist)."""
        for label in self.labels:
            run("ip", "netns", "del", self.namespace(label), check=False)
            run("ip", "link", "del", self.veth(label)[0], check=False)
        run("ip", "link", "del", self.bridge, check=False)

    def setup(self) -> None:
        """Make the bridge and the namespaces, after removing what a crashed run left."""
        self.teardown()
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for index, label in enumerate(self.labels, start=2):
            ns, (outer, inner) = self.namespace(label), self.veth(label)
            run("ip", "netns", "add", ns)
            run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            run("ip", "link", "set", inner, "netns", ns)
            run("ip", "link", "set", outer, "master", self.bridge)
            run("ip", "link", "set", outer, "up")
            run("ip", "-n", ns, "addr", "add", f"{self.subnet}.{index}/24", "dev", inner)
            run("ip", "-n", ns, "link", "set", inner, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")  # the engines listen on its 127.0.0.1

    def start_agent(self, cluster: Cluster, agent: Agent, label: str) -> None:
        """Start ``agent`` (enrolled by ``cluster``) inside ``label``'s namespace and wait
        until ``cluster`` has its node ready."""
        with (agent.home / "agent.out").open("ab") as log:
            agent.process = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace(label), sys.executable, "-m", "berth",
                 "--home", str(agent.home), "agent", "start", "--verbose"],
                stdout=log, stderr=subprocess.STDOUT, env={**cluster.env, **agent.env},
                cwd=agent.home, start_new_session=True,
            )  # fmt: skip
        cluster.wait_node(agent.node_id, "ready")
