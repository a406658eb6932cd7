"""The agent policy where engines start: read from ``agent.yaml`` (``policy:``), and enforced
by the agent core before every start (:func:`enforce_start`, :func:`enforce_mounts`).

The same core runs node ``local`` inside the leader, with the leader's ``[agent_policy]``
settings (:meth:`berth.config.Settings.agent_policy`).  The rules and their order are
:mod:`berth.vocab.agent_policy`'s; here paths are resolved on this host
(``os.path.realpath``: symlinks and ``..``), so a link inside a root that points outside it
is refused.

``agent.yaml``::

    policy:
      engines: [llamacpp, vllm, sglang]
      images: ["vllm/vllm-openai*", "lmsysorg/sglang*", "ghcr.io/ggml-org/llama.cpp:*"]
      model_roots: [/var/lib/berth/models, /root/.cache/huggingface/hub]
      gpus: all
      allow_args: []
      refuse_args: []

Every key may be left out: it keeps the value of the agent's ``[agent_policy]`` settings
(``config.toml`` in its home, or ``BERTH_POLICY_*``), else of the default policy
(:func:`~berth.vocab.agent_policy.default_agent_policy`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from berth.errors import ConfigError, PolicyError
from berth.runtime.base import LaunchSpec
from berth.vocab.agent_policy import (
    AgentPolicy,
    PolicyFormatError,
    PolicyRefusal,
    check_mounts,
    check_path,
    check_start,
    policy_from_fields,
)
from berth.vocab.deployment_request import DeploymentRequest

#: The key of the policy in ``agent.yaml``.
POLICY_KEY = "policy"


def policy_from_document(
    document: Mapping[str, object], *, path: Path, base: AgentPolicy
) -> AgentPolicy:
    """The policy ``agent.yaml`` (read into ``document``, found at ``path``) gives: its
    ``policy:`` mapping over ``base`` (the agent's ``[agent_policy]`` settings over the
    default policy, :meth:`berth.config.Settings.agent_policy`).

    Raises :class:`ConfigError` naming ``path`` and the key when the policy is malformed.
    """
    fields = document.get(POLICY_KEY)
    if fields is None:
        return base
    if not isinstance(fields, dict) or not all(isinstance(key, str) for key in fields):
        raise ConfigError(f"{POLICY_KEY}: expected a mapping of policy keys", path=path)
    try:
        return policy_from_fields(fields, base)
    except PolicyFormatError as exc:
        raise ConfigError(f"{POLICY_KEY}: {exc}", path=path) from None


def _raise(refusal: PolicyRefusal | None) -> None:
    if refusal is not None:
        raise PolicyError(str(refusal), rule=refusal.rule)


def enforce_start(request: DeploymentRequest, policy: AgentPolicy | None) -> None:
    """Raise :class:`PolicyError` naming the rule when ``policy`` refuses ``request``
    (``None``: no policy, as in tests that build a core by hand).  Resolves paths on this
    host, so call it off the event loop."""
    if policy is None:
        return
    _raise(check_start(request, policy, resolve=os.path.realpath))
    if request.model_path.is_dir():
        _raise(_links_in_folder(request.model_path, policy))


def _links_in_folder(folder: Path, policy: AgentPolicy) -> PolicyRefusal | None:
    """Refusal ``model_roots`` for a symlink in the model folder ``folder`` that points
    outside the roots (the engine would read its target); a Hugging Face snapshot's links
    into its cache's ``blobs`` stay inside the cache, a root."""
    for entry in folder.rglob("*"):
        if entry.is_symlink():
            refused = check_path(
                f"model file {entry} (a link to {os.path.realpath(entry)})",
                str(entry),
                policy,
                os.path.realpath,
            )
            if refused is not None:
                return refused
    return None


def enforce_path(what: str, path: str, policy: AgentPolicy | None) -> None:
    """Raise :class:`PolicyError` (rule ``model_roots``) when ``path``, a file an engine is
    told to read while it runs (a LoRA adapter to load), lies outside the model roots."""
    if policy is not None:
        _raise(check_path(what, path, policy, os.path.realpath))


def enforce_mounts(spec: LaunchSpec, policy: AgentPolicy | None, own: Sequence[Path]) -> None:
    """Raise :class:`PolicyError` (rule ``docker``) when ``spec``'s container would mount a
    folder outside the model roots and outside ``own`` (berth's key files)."""
    if policy is None or spec.container is None:
        return
    sources = [mount.source for mount in spec.container.mounts]
    _raise(check_mounts(sources, policy, os.path.realpath, own=own))
