"""What a GPU host lets berth run on it: the agent policy (:class:`AgentPolicy`), read from
``agent.yaml`` on an agent and from ``[agent_policy]`` on a leader for its own node, and the
one checker of a start against it (:func:`check_start`), which answers a
:class:`PolicyRefusal` naming the rule broken, or ``None``.

The rules (:data:`PolicyRule`), in the order :func:`check_start` applies them:

1. ``engines``: the engine is one of those allowed;
2. ``images``: a container's image matches one of the patterns (``fnmatch``: ``*``, ``?``,
   ``[...]``), or is ``name@sha256:<digest>`` with that exact digest listed;
3. ``model_roots``: the model path and every LoRA file lie under a root, compared after
   symlinks and ``..`` are resolved;
4. ``engine_args``: no extra argument the table of :mod:`berth.vocab.engine_args` refuses
   (unless ``allow_args`` names it), none of ``refuse_args``, and every file a flag names
   under a root (chat templates, draft models, ...); then the backstop for flags the table
   does not know (:func:`check_unknown_values`): no URL value, and no value that looks like
   a path outside the roots, unless ``allow_args`` names the flag;
5. ``gpus``: every GPU index asked for is one the host hands out (``None``: any).

The docker options berth sets are rule ``docker`` (:func:`check_mounts`): a container's
bind mounts come from the model roots only (and berth's own key files); berth never asks
for a privileged container or the host's network or PID namespace, which
``runtime/docker`` has no way to ask for at all.

Pure: resolving a path on the host is the caller's ``resolve`` (``os.path.realpath`` on the
agent; ``os.path.normpath`` on the leader, which cannot see another host's links).
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from berth.errors import ConfigError
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engine_args import (
    entries_for,
    flag_values,
    names_a_path,
    uses_argparse,
)
from berth.vocab.engines import ENGINE_NAMES, EngineName, parse_engine_name
from berth.vocab.images import DEFAULT_IMAGES

PolicyRule = Literal["engines", "images", "model_roots", "engine_args", "gpus", "docker"]

#: Turns a path on the host into the one it names (symlinks and ``..`` resolved).
Resolve = Callable[[str], str]

#: The images allowed by default: the official images of vLLM and SGLang, and llama.cpp's
#: (:data:`~berth.vocab.images.DEFAULT_IMAGES`, which the docker runtime runs unless told).
DEFAULT_IMAGE_PATTERNS: tuple[str, ...] = (
    "vllm/vllm-openai*",
    "lmsysorg/sglang*",
    "ghcr.io/ggml-org/llama.cpp:*",
)


@dataclass(frozen=True)
class PolicyRefusal:
    """A start the policy refuses: ``rule`` for programs, ``message`` for people (it names
    the rule and what the policy allows)."""

    rule: PolicyRule
    message: str

    def __str__(self) -> str:
        return f"refused by the agent policy ({self.rule}): {self.message}"


@dataclass(frozen=True)
class AgentPolicy:
    """What a host lets berth start.

    ``engines``: the engines allowed.  ``images``: ``fnmatch`` patterns or
    ``name@sha256:<hex>`` references a container's image must match.  ``model_roots``:
    absolute folders; every path an engine is given lies under one.  ``gpus``: the GPU
    indexes berth may hand out (``None``: every GPU).  ``allow_args``: flags of
    :data:`~berth.vocab.engine_args.ENGINE_ARGS` this host allows anyway;
    ``refuse_args``: further flags it refuses.
    """

    engines: frozenset[EngineName] = frozenset(ENGINE_NAMES)
    images: tuple[str, ...] = DEFAULT_IMAGE_PATTERNS
    model_roots: tuple[Path, ...] = ()
    gpus: tuple[int, ...] | None = None
    allow_args: frozenset[str] = frozenset()
    refuse_args: frozenset[str] = frozenset()

    def summary(self) -> str:
        """One line for logs and ``berth nodes show``; ``allow_args`` and ``refuse_args``
        are named when set, so a host that allows a refused flag does not read as a default
        one."""
        gpus = "all" if self.gpus is None else ",".join(map(str, self.gpus)) or "none"
        line = (
            f"engines: {', '.join(sorted(self.engines))}; images: {', '.join(self.images)}; "
            f"model roots: {', '.join(map(str, self.model_roots)) or 'none'}; GPUs: {gpus}"
        )
        if self.allow_args:
            line += f"; allow_args: {', '.join(sorted(self.allow_args))}"
        if self.refuse_args:
            line += f"; refuse_args: {', '.join(sorted(self.refuse_args))}"
        return line


def default_model_roots(models_dir: Path, env: Mapping[str, str]) -> tuple[Path, ...]:
    """The default model roots: berth's models folder (``$BERTH_HOME/models``, where pulls
    land) and the Hugging Face hub cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``, as huggingface_hub resolves it).  The cache's ``hub``
    folder, not ``HF_HOME`` itself: ``HF_HOME`` also holds the user's access token."""
    hub = env.get("HF_HUB_CACHE")
    if not hub:
        hf_home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or "/root", ".cache"),
            "huggingface",
        )
        hub = os.path.join(hf_home, "hub")
    return (models_dir, Path(hub))


def default_agent_policy(models_dir: Path, env: Mapping[str, str]) -> AgentPolicy:
    """The policy a host gets when it configures none: every engine, the official images,
    :func:`default_model_roots`, every GPU, and the table's refusals."""
    return AgentPolicy(model_roots=default_model_roots(models_dir, env))


# -- reading -----------------------------------------------------------------------------------

#: The keys of a policy in ``agent.yaml`` (``policy:``) and their meaning.
POLICY_KEYS = ("engines", "images", "model_roots", "gpus", "allow_args", "refuse_args")


#: An image digest as a policy pins it (``name@sha256:<64 hex digits>``).
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class PolicyFormatError(ValueError):
    """A policy's fields are malformed; the caller names the file (``ConfigError``)."""


def policy_from_fields(fields: Mapping[str, object], base: AgentPolicy) -> AgentPolicy:
    """``base`` with the fields given in ``fields`` (keys of :data:`POLICY_KEYS`; lists of
    strings, ``gpus`` a list of indexes or ``"all"``) in its place.

    An empty list means none (``model_roots: []``: no folder; ``gpus: []``: no GPU); an
    empty string is refused, since it reads as "unset" but would mean none.

    Raises :class:`PolicyFormatError` naming the key for an unknown key, a value of the
    wrong shape or an empty string, an unknown engine, an image digest that is not
    ``sha256:`` and 64 hexadecimal digits, a relative model root, or a flag without its
    leading ``-``.
    """
    unknown = sorted(set(fields) - set(POLICY_KEYS))
    if unknown:
        raise PolicyFormatError(
            f"unknown policy key {unknown[0]!r} (known: {', '.join(POLICY_KEYS)})"
        )
    policy = base
    if "engines" in fields:
        names = _strings(fields["engines"], "engines")
        try:
            engines = frozenset(parse_engine_name(name) for name in names)
        except ConfigError as exc:
            raise PolicyFormatError(f"engines: {exc}") from None
        policy = replace(policy, engines=engines)
    if "images" in fields:
        images = tuple(_strings(fields["images"], "images"))
        for image in images:
            _, at, digest = image.partition("@")
            if at and not _DIGEST.fullmatch(digest):
                raise PolicyFormatError(
                    f"images: {image!r}: a digest is sha256: and 64 hexadecimal digits"
                )
        policy = replace(policy, images=images)
    if "model_roots" in fields:
        roots = []
        for text in _strings(fields["model_roots"], "model_roots"):
            root = Path(os.path.expanduser(text))
            if not root.is_absolute():
                raise PolicyFormatError(f"model_roots: {text!r} is not an absolute path")
            roots.append(Path(os.path.normpath(root)))
        policy = replace(policy, model_roots=tuple(roots))
    if "gpus" in fields:
        policy = replace(policy, gpus=_gpus(fields["gpus"]))
    if "allow_args" in fields:
        # A flag the table does not know is allowed too: it lets that flag take a URL or a
        # path outside the model roots (the backstop, check_unknown_values).
        policy = replace(policy, allow_args=_flags(fields["allow_args"], "allow_args"))
    if "refuse_args" in fields:
        policy = replace(policy, refuse_args=_flags(fields["refuse_args"], "refuse_args"))
    return policy


def split_list(text: str) -> list[str]:
    """A comma list as a setting gives it (``"a, b"``), blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _strings(value: object, key: str) -> list[str]:
    if isinstance(value, str):
        if not value.strip():
            raise PolicyFormatError(
                f"{key}: an empty value names nothing; leave {key} out for the default, or "
                "give an empty list ([]) to allow nothing"
            )
        return split_list(value)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise PolicyFormatError(f"{key}: expected a list of strings")
    return [item.strip() for item in value if item.strip()]


def _flags(value: object, key: str) -> frozenset[str]:
    flags = _strings(value, key)
    for flag in flags:
        if not flag.startswith("-") or "=" in flag:
            raise PolicyFormatError(f"{key}: {flag!r} is not a flag (like --log-file)")
    return frozenset(flags)


def _gpus(value: object) -> tuple[int, ...] | None:
    if isinstance(value, str):
        if value.strip().lower() == "all":
            return None
        if not value.strip():
            raise PolicyFormatError(
                "gpus: an empty value names nothing; leave gpus out for all, or give an "
                "empty list ([]) to hand out none"
            )
        parts = split_list(value)
        if not all(part.isdigit() for part in parts):
            raise PolicyFormatError(f"gpus: expected 'all' or GPU indexes, not {value!r}")
        return tuple(sorted({int(part) for part in parts}))
    if isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in value
    ):
        return tuple(sorted(set(value)))
    raise PolicyFormatError("gpus: expected 'all' or a list of GPU indexes")


# -- checking ----------------------------------------------------------------------------------


def check_start(
    request: DeploymentRequest, policy: AgentPolicy, *, resolve: Resolve
) -> PolicyRefusal | None:
    """The first rule ``request`` breaks (in the module docstring's order), or ``None``.

    A docker request without an image is checked with the engine's default image (the one
    the agent's runtime then runs: :data:`~berth.vocab.images.DEFAULT_IMAGES`).
    """
    image = None
    if request.runtime == "docker":
        image = request.image or DEFAULT_IMAGES[request.engine]
    return (
        check_engine(request.engine, policy)
        or (check_image(image, policy) if image is not None else None)
        or check_path("model path", str(request.model_path), policy, resolve)
        or next(
            (
                refused
                for lora in request.lora_files
                if (refused := check_path("LoRA file", str(lora), policy, resolve)) is not None
            ),
            None,
        )
        or check_args(request.engine, request.extra_args, policy, resolve)
        or check_gpus(request.gpus, policy)
    )


def check_engine(engine: EngineName, policy: AgentPolicy) -> PolicyRefusal | None:
    if engine in policy.engines:
        return None
    allowed = ", ".join(sorted(policy.engines)) or "none"
    return PolicyRefusal("engines", f"engine {engine} is not allowed (engines: {allowed})")


def image_allowed(image: str, patterns: Iterable[str]) -> bool:
    """Whether ``image`` matches a pattern: a digest reference only the same digest, any
    other pattern by ``fnmatch`` (case-sensitive, as image names are)."""
    for pattern in patterns:
        if "@sha256:" in pattern:
            name, _, digest = pattern.partition("@")
            image_name, _, image_digest = image.partition("@")
            if image_digest == digest and _untagged(image_name) == _untagged(name):
                return True
            continue
        if fnmatch.fnmatchcase(image, pattern):
            return True
    return False


def _untagged(name: str) -> str:
    """``name`` without its ``:tag`` (a registry's ``:port`` is kept)."""
    head, colon, tag = name.rpartition(":")
    return head if colon and "/" not in tag else name


def check_image(image: str, policy: AgentPolicy) -> PolicyRefusal | None:
    if image_allowed(image, policy.images):
        return None
    allowed = ", ".join(policy.images) or "none"
    return PolicyRefusal("images", f"image {image} is not allowed (images: {allowed})")


def under_roots(path: str, roots: Sequence[Path], resolve: Resolve) -> bool:
    """Whether ``path`` (absolute), once ``resolve``d, is a root or lies below one (each
    root resolved too)."""
    if not os.path.isabs(path):
        return False
    real = resolve(path)
    for root in roots:
        top = resolve(str(root))
        if real == top or real.startswith(top.rstrip("/") + "/"):
            return True
    return False


def check_path(what: str, path: str, policy: AgentPolicy, resolve: Resolve) -> PolicyRefusal | None:
    """Refusal ``model_roots`` when ``path`` does not lie under a model root."""
    if under_roots(path, policy.model_roots, resolve):
        return None
    roots = ", ".join(map(str, policy.model_roots)) or "none"
    shown = path if os.path.isabs(path) else f"{path} (a relative path)"
    return PolicyRefusal("model_roots", f"{what} {shown} is outside the model roots ({roots})")


def check_args(
    engine: EngineName, args: Sequence[str], policy: AgentPolicy, resolve: Resolve
) -> PolicyRefusal | None:
    """Refusal ``engine_args`` for the first argument the table or ``refuse_args`` refuses,
    or whose file lies outside the model roots; both ``--flag VALUE`` and ``--flag=VALUE``."""
    argparse = uses_argparse(engine)
    for entry in entries_for(engine):
        if entry.rule == "refused":
            if any(flag in policy.allow_args for flag in entry.flags):
                continue
            found = flag_values(
                args, frozenset(entry.flags), takes_value=entry.takes_value, argparse=argparse
            )
            if found:
                return PolicyRefusal(
                    "engine_args",
                    f"extra argument {found[0].flag} is refused: it {entry.why} "
                    f"(allow it on this host with allow_args: [{entry.name}])",
                )
            continue
        for given in flag_values(args, frozenset(entry.flags), takes_value=True, argparse=argparse):
            if given.value is None:
                continue
            values = given.value.split(",") if entry.comma_list else [given.value]
            if entry.scaled:
                values = [value.rpartition(":")[0] or value for value in values]
            for value in values:
                if not names_a_path(entry.rule, value):
                    continue
                text = os.path.expanduser(value)
                if not under_roots(text, policy.model_roots, resolve):
                    roots = ", ".join(map(str, policy.model_roots)) or "none"
                    return PolicyRefusal(
                        "engine_args",
                        f"extra argument {given.flag} {value}: the file is outside the model "
                        f"roots ({roots}); it {entry.why}",
                    )
    for given in flag_values(args, policy.refuse_args, takes_value=False, argparse=argparse):
        return PolicyRefusal(
            "engine_args", f"extra argument {given.flag} is refused by this host's refuse_args"
        )
    return check_unknown_values(engine, args, policy, resolve)


def check_unknown_values(
    engine: EngineName, args: Sequence[str], policy: AgentPolicy, resolve: Resolve
) -> PolicyRefusal | None:
    """The backstop for flags the table does not know: refusal ``engine_args`` for a value
    that is a URL (holds ``://``) or looks like a path (``/``, ``~``, ``./`` or ``../``
    first, or is ``.`` or ``..``) outside the model roots, unless its flag is in
    ``allow_args``.  A value is the argument after a flag or the part after ``=``; each
    item of a comma list counts, and of ``FNAME:SCALE`` the part before the ``:``."""
    allowed = _allowed_spellings(engine, policy)
    for flag, value in _flag_value_pairs(args):
        if flag is not None and _normal(engine, flag) in allowed:
            continue
        shown = flag or "(no flag)"
        for item in value.split(","):
            if "://" in item:
                return PolicyRefusal(
                    "engine_args",
                    f"extra argument {shown} {value}: a URL is refused for a flag the policy "
                    f"does not know (allow it on this host with allow_args: [{shown}])",
                )
            path = item if _looks_like_path(item) else item.rpartition(":")[0]
            if not _looks_like_path(path):
                continue
            if not under_roots(os.path.expanduser(path), policy.model_roots, resolve):
                roots = ", ".join(map(str, policy.model_roots)) or "none"
                return PolicyRefusal(
                    "engine_args",
                    f"extra argument {shown} {value}: the path is outside the model roots "
                    f"({roots}) (allow it on this host with allow_args: [{shown}])",
                )
    return None


def _looks_like_path(value: str) -> bool:
    return value in (".", "..") or value.startswith(("/", "~", "./", "../"))


def _normal(engine: EngineName, flag: str) -> str:
    return flag.replace("_", "-") if uses_argparse(engine) and flag.startswith("--") else flag


def _allowed_spellings(engine: EngineName, policy: AgentPolicy) -> frozenset[str]:
    """The flags the backstop passes over: ``allow_args`` with every other spelling of the
    table's entries it names, and the table's path flags (checked by their own rule)."""
    allowed = {_normal(engine, flag) for flag in policy.allow_args}
    for entry in entries_for(engine):
        if entry.rule != "refused" or any(flag in policy.allow_args for flag in entry.flags):
            allowed.update(entry.flags)
    return frozenset(allowed)


def _flag_value_pairs(args: Sequence[str]) -> list[tuple[str | None, str]]:
    """Each value of ``args`` with the flag it follows (``None`` before any flag):
    ``--flag=VALUE`` and ``--flag VALUE``; a flag without a value gives none."""
    pairs: list[tuple[str | None, str]] = []
    flag: str | None = None
    for arg in args:
        if arg.startswith("-") and not _is_number(arg):
            name, equals, inline = arg.partition("=")
            if equals:
                pairs.append((name, inline))
                flag = None
            else:
                flag = name
            continue
        pairs.append((flag, arg))
    return pairs


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_gpus(gpus: Sequence[int], policy: AgentPolicy) -> PolicyRefusal | None:
    if policy.gpus is None:
        return None
    outside = [g for g in gpus if g not in policy.gpus]
    if not outside:
        return None
    allowed = ", ".join(map(str, policy.gpus)) or "none"
    listed = ", ".join(map(str, outside))
    return PolicyRefusal("gpus", f"GPU {listed} is not handed out here (gpus: {allowed})")


def check_mounts(
    sources: Sequence[Path], policy: AgentPolicy, resolve: Resolve, *, own: Sequence[Path] = ()
) -> PolicyRefusal | None:
    """Refusal ``docker`` for a bind mount source outside the model roots and outside
    ``own`` (berth's own folders: the engine key files)."""
    for source in sources:
        if under_roots(str(source), [*policy.model_roots, *own], resolve):
            continue
        roots = ", ".join(map(str, policy.model_roots)) or "none"
        return PolicyRefusal(
            "docker", f"the container would mount {source}, outside the model roots ({roots})"
        )
    return None
