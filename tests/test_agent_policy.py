"""The agent policy in-process: its checker (one table of cases), paths resolved on the host
(a symlink or ``..`` leaving a root), the ``=`` spelling of flags, image patterns and
digests, the docker mounts, reading it from ``agent.yaml`` and ``[agent_policy]``, the
agent core refusing before anything starts, and placement leaving out a node whose policy
would refuse, with the reason."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from berth.agent.core import AgentCore
from berth.agent.identity import read_agent_document
from berth.agent.policy import enforce_mounts, enforce_path, enforce_start, policy_from_document
from berth.config import Settings
from berth.errors import ConfigError, PolicyError
from berth.paths import BerthHome
from berth.placement import (
    GpuFacts,
    NodeFacts,
    PlacementPolicy,
    PlacementRequest,
    VramEstimate,
    plan_placement,
)
from berth.placement.result import Placement, Refusal
from berth.runtime.base import ContainerSpec, LaunchSpec, Mount
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import StaticInventory
from berth.runtime.process import ProcessRuntime
from berth.vocab.agent_policy import (
    DEFAULT_IMAGE_PATTERNS,
    AgentPolicy,
    PolicyFormatError,
    check_start,
    default_agent_policy,
    image_allowed,
    policy_from_fields,
)
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engine_args import ENGINE_ARGS, KNOWN_FLAGS
from berth.vocab.records import ModelRecord

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    """``tmp_path/models`` (the one root) holding ``m.gguf``, and ``tmp_path/outside``
    holding ``secret.txt``."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("no")
    return tmp_path


def _policy(root: Path, **changes: object) -> AgentPolicy:
    return replace(AgentPolicy(model_roots=(root / "models",)), **changes)  # type: ignore[arg-type]


def _request(root: Path, **changes: object) -> DeploymentRequest:
    base = DeploymentRequest("d-00000001", "m", root / "models" / "m.gguf", "llamacpp", 0, Path())
    return replace(base, **changes)  # type: ignore[arg-type]


# (what, request changes, policy changes, rule or None, words of the message)
CASES: list[tuple[str, dict[str, object], dict[str, object], str | None, str]] = [
    ("a start inside every rule", {}, {}, None, ""),
    ("an engine not allowed", {"engine": "vllm"}, {"engines": frozenset({"llamacpp"})},
     "engines", "engine vllm is not allowed (engines: llamacpp)"),
    ("an image outside the patterns", {"runtime": "docker", "image": "evil/miner:1"}, {},
     "images", "image evil/miner:1 is not allowed"),
    ("the official vLLM image", {"engine": "vllm", "runtime": "docker",
                                 "image": "vllm/vllm-openai:v0.9.0"}, {}, None, ""),
    ("llama.cpp's default image, when none is named", {"runtime": "docker"}, {}, None, ""),
    ("a default image the host does not allow", {"runtime": "docker"},
     {"images": ("vllm/*",)}, "images", "image ghcr.io/ggml-org/llama.cpp:server is not"),
    ("vLLM's --trust-remote-code", {"engine": "vllm", "extra_args": ("--trust-remote-code",)},
     {}, "engine_args", "--trust-remote-code is refused: it runs the Python code"),
    ("SGLang's --trust-remote-code", {"engine": "sglang",
                                      "extra_args": ("--trust-remote-code",)},
     {}, "engine_args", "--trust-remote-code is refused"),
    ("--trust-remote-code allowed by the host", {"engine": "vllm",
                                                 "extra_args": ("--trust-remote-code",)},
     {"allow_args": frozenset({"--trust-remote-code"})}, None, ""),
    ("--log-file FILE", {"extra_args": ("--log-file", "/tmp/x.log")}, {}, "engine_args",
     "extra argument --log-file is refused: it writes to any file"),
    ("--slot-save-path=DIR", {"extra_args": ("--slot-save-path=/tmp",)}, {}, "engine_args",
     "extra argument --slot-save-path is refused"),
    ("a short spelling, -ag", {"extra_args": ("-ag",)}, {}, "engine_args",
     "extra argument -ag is refused"),
    ("a flag another engine refuses", {"extra_args": ("--trust-remote-code",)}, {}, None, ""),
    ("an argparse prefix of --trust-remote-code", {"engine": "vllm",
                                                   "extra_args": ("--trust-remote",)},
     {}, "engine_args", "extra argument --trust-remote is refused"),
    ("--trust_remote_code, as vLLM reads it", {"engine": "vllm",
                                               "extra_args": ("--trust_remote_code",)},
     {}, "engine_args", "extra argument --trust_remote_code is refused"),
    ("vLLM's --config file", {"engine": "vllm", "extra_args": ("--config", "/tmp/x.yaml")},
     {}, "engine_args", "reads more flags from a file"),
    ("no prefixes for llama.cpp", {"extra_args": ("--log-fil", "x")}, {}, None, ""),
    ("a host's own refuse_args", {"extra_args": ("--props",)},
     {"refuse_args": frozenset({"--props"})}, "engine_args", "--props is refused by this host"),
    ("a GPU the host keeps", {"gpus": (0, 2)}, {"gpus": (0, 1)}, "gpus",
     "GPU 2 is not handed out here (gpus: 0, 1)"),
    ("GPUs the host hands out", {"gpus": (1,)}, {"gpus": (0, 1)}, None, ""),
    ("an inline chat template", {"engine": "vllm",
                                 "extra_args": ("--chat-template", "{{ messages }}")},
     {}, None, ""),
    ("a hub tokenizer", {"engine": "vllm", "extra_args": ("--tokenizer", "org/tok")},
     {}, None, ""),
]  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "policy_changes", "rule", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_check_start(
    roots: Path,
    changes: dict[str, object],
    policy_changes: dict[str, object],
    rule: str | None,
    words: str,
) -> None:
    found = check_start(
        _request(roots, **changes), _policy(roots, **policy_changes), resolve=os.path.realpath
    )
    if rule is None:
        assert found is None
        return
    assert found is not None
    assert (found.rule, words in found.message) == (rule, True), found.message


@pytest.mark.parametrize(
    "args",
    [
        ("--chat-template-file", "{outside}/secret.txt"),
        ("--chat-template-file={outside}/secret.txt",),
        ("--chat-template-file", "{root}/models/../outside/secret.txt"),
        ("--chat-template-file", "{root}/models/link/secret.txt"),
        ("--chat-template-file", "relative/secret.txt"),
        ("--lora", "{root}/models/m.gguf,{outside}/secret.txt"),
        ("-m", "{outside}/secret.txt"),
    ],
    ids=["space", "equals", "dot-dot", "symlink", "relative", "comma-list", "second-model"],
)
def test_a_file_flag_outside_the_roots_is_refused(roots: Path, args: tuple[str, ...]) -> None:
    (roots / "models" / "link").symlink_to(roots / "outside")
    given = tuple(a.format(root=roots, outside=roots / "outside") for a in args)
    found = check_start(_request(roots, extra_args=given), _policy(roots), resolve=os.path.realpath)
    assert found is not None and found.rule == "engine_args", found
    assert "is outside the model roots" in found.message


def test_a_file_flag_inside_the_roots_is_allowed(roots: Path) -> None:
    template = roots / "models" / "chat.jinja"
    template.write_text("{{ messages }}")
    args = ("--chat-template-file", str(template), f"--grammar-file={template}")
    assert check_start(_request(roots, extra_args=args), _policy(roots),
                       resolve=os.path.realpath) is None  # fmt: skip


def test_a_model_behind_a_symlink_that_leaves_the_roots_is_refused(roots: Path) -> None:
    (roots / "outside" / "real.gguf").write_bytes(b"GGUF")
    (roots / "models" / "looks-inside.gguf").symlink_to(roots / "outside" / "real.gguf")
    request = _request(roots, model_path=roots / "models" / "looks-inside.gguf")
    found = check_start(request, _policy(roots), resolve=os.path.realpath)
    assert found is not None and found.rule == "model_roots"
    assert found.message == (
        f"model path {roots}/models/looks-inside.gguf is outside the model roots ({roots}/models)"
    )
    # The leader compares as written: it cannot see the agent's links.
    assert check_start(request, _policy(roots), resolve=os.path.normpath) is None


def test_a_root_is_not_a_prefix_of_its_neighbour(roots: Path) -> None:
    (roots / "models-evil").mkdir()
    (roots / "models-evil" / "m.gguf").write_bytes(b"GGUF")
    request = _request(roots, model_path=roots / "models-evil" / "m.gguf")
    found = check_start(request, _policy(roots), resolve=os.path.realpath)
    assert found is not None and found.rule == "model_roots"


def test_lora_files_must_lie_under_the_roots(roots: Path) -> None:
    request = _request(roots, lora_files=(roots / "outside" / "secret.txt",))
    found = check_start(request, _policy(roots), resolve=os.path.realpath)
    assert found is not None and found.rule == "model_roots"
    assert found.message.startswith("LoRA file ")


@pytest.mark.parametrize(
    ("image", "patterns", "allowed"),
    [
        ("vllm/vllm-openai:latest", DEFAULT_IMAGE_PATTERNS, True),
        ("lmsysorg/sglang:v0.5.0-cu126", DEFAULT_IMAGE_PATTERNS, True),
        ("ghcr.io/ggml-org/llama.cpp:server-cuda", DEFAULT_IMAGE_PATTERNS, True),
        ("vllm/vllm-openai-evil:latest", ("vllm/vllm-openai:*",), False),
        ("docker.io/vllm/vllm-openai:latest", DEFAULT_IMAGE_PATTERNS, False),
        (f"vllm/vllm-openai@{DIGEST}", (f"vllm/vllm-openai@{DIGEST}",), True),
        (f"vllm/vllm-openai:v1@{DIGEST}", (f"vllm/vllm-openai@{DIGEST}",), True),
        ("vllm/vllm-openai:latest", (f"vllm/vllm-openai@{DIGEST}",), False),
        (f"other/image@{DIGEST}", (f"vllm/vllm-openai@{DIGEST}",), False),
        (f"vllm/vllm-openai@sha256:{'cd' * 32}", (f"vllm/vllm-openai@{DIGEST}",), False),
        ("localhost:5000/berth/llama:1", ("localhost:5000/berth/*",), True),
    ],
)
def test_image_patterns_and_digests(image: str, patterns: tuple[str, ...], allowed: bool) -> None:
    assert image_allowed(image, patterns) is allowed


def test_the_table_names_its_sources_and_refuses_what_the_issue_lists() -> None:
    assert all(entry.source and entry.why for entry in ENGINE_ARGS)
    refused = {flag for e in ENGINE_ARGS if e.rule == "refused" for flag in e.flags}
    assert {"--trust-remote-code", "--log-file", "--slot-save-path"} <= refused
    assert "--chat-template-file" in KNOWN_FLAGS and "--chat-template-file" not in refused


def test_docker_mounts_come_from_the_roots_or_berths_own_folders(roots: Path) -> None:
    keys = roots / "engine-keys"

    def spec(*sources: Path) -> LaunchSpec:
        mounts = tuple(Mount(source, f"/m{i}") for i, source in enumerate(sources))
        container = ContainerSpec("vllm/vllm-openai:latest", (), 8000, mounts=mounts)
        return LaunchSpec("d-1", (), 0, "/health", "m", Path(), container=container)

    enforce_mounts(spec(roots / "models", keys / "d-1.sglang.yaml"), _policy(roots), own=(keys,))
    with pytest.raises(PolicyError) as refused:
        enforce_mounts(spec(roots), _policy(roots), own=(keys,))
    assert refused.value.rule == "docker"
    assert f"the container would mount {roots}, outside the model roots" in str(refused.value)


def test_berths_docker_containers_ask_for_no_privilege_or_host_namespace() -> None:
    """What ``runtime/docker`` can ask Docker for: nothing of ``privileged``,
    ``network_mode``, ``pid_mode``, capabilities or devices besides the GPUs."""
    from dataclasses import fields

    from berth.runtime.docker.api import ContainerConfig

    names = {f.name for f in fields(ContainerConfig)}
    assert not names & {"privileged", "network_mode", "pid_mode", "cap_add", "devices",
                        "ipc_mode", "userns_mode", "security_opt"}  # fmt: skip
    source = Path(__file__).parents[1] / "src" / "berth" / "runtime" / "docker" / "sdk.py"
    text = source.read_text()
    for option in ("privileged", "network_mode", "pid_mode", "cap_add", "ipc_mode"):
        assert f'"{option}"' not in text


@pytest.mark.parametrize(
    ("engine", "args", "words"),
    [
        ("llamacpp", ("--lora-scaled", "{outside}/secret.txt:0.5"), "is outside the model roots"),
        ("llamacpp", ("--lora-scaled", "{root}/models/m.gguf:1,{outside}/secret.txt:0.5"),
         "is outside the model roots"),
        ("llamacpp", ("--control-vector", "{outside}/secret.txt"), "is outside the model roots"),
        ("llamacpp", ("--control-vector", "{root}/models/m.gguf,{outside}/secret.txt"),
         "is outside the model roots"),
        ("llamacpp", ("--control-vector-scaled={outside}/secret.txt:0.8",),
         "is outside the model roots"),
        ("llamacpp", ("-mmu", "https://example.com/p.gguf"), "-mmu is refused: it downloads"),
        ("llamacpp", ("--mmproj-url", "https://example.com/p.gguf"), "--mmproj-url is refused"),
        ("llamacpp", ("--video-ffmpeg-dir", "{root}/models"), "runs ffmpeg"),
        ("llamacpp", ("--host", "{root}/models/sock"), "--host is refused"),
        ("llamacpp", ("--host", "0.0.0.0"), "--host is refused"),
        ("llamacpp", ("--port=9999",), "--port is refused"),
        ("llamacpp", ("-hfd", "org/draft"), "-hfd is refused"),
        ("llamacpp", ("--gpt-oss-20b-default",), "downloads a preset model"),
        ("llamacpp", ("--rpc", "10.0.0.9:50052"), "--rpc is refused"),
        ("vllm", ("--host", "0.0.0.0"), "--host is refused"),
        ("vllm", ("--uds", "/tmp/x.sock"), "--uds is refused"),
        ("sglang", ("--port", "1"), "--port is refused"),
        # the backstop, for flags the table does not know
        ("llamacpp", ("--frobnicate", "https://example.com/x"), "a URL is refused"),
        ("llamacpp", ("--frobnicate=s3://bucket/x",), "a URL is refused"),
        ("vllm", ("--frobnicate", "{outside}/secret.txt"), "the path is outside the model roots"),
        ("sglang", ("--frobnicate", "~/secret.txt"), "the path is outside the model roots"),
        ("llamacpp", ("--frobnicate", "../secret.txt"), "the path is outside the model roots"),
        ("llamacpp", ("--frobnicate", "."), "the path is outside the model roots"),
        ("llamacpp", ("--frobnicate", "a,/etc/passwd"), "the path is outside the model roots"),
        ("llamacpp", ("--frobnicate", "/etc/passwd:1.0"), "the path is outside the model roots"),
    ],
)  # fmt: skip
def test_flags_the_tester_found_and_the_backstop_are_refused(
    roots: Path, engine: str, args: tuple[str, ...], words: str
) -> None:
    given = tuple(a.format(root=roots, outside=roots / "outside") for a in args)
    request = _request(roots, engine=engine, extra_args=given)
    found = check_start(request, _policy(roots), resolve=os.path.realpath)
    assert found is not None and found.rule == "engine_args", found
    assert words in found.message, found.message


@pytest.mark.parametrize(
    ("args", "allow"),
    [
        (("--lora-scaled", "{root}/models/m.gguf:0.5"), ()),
        (("--control-vector-scaled", "{root}/models/m.gguf:0.5,{root}/models/m.gguf:1"), ()),
        (("--frobnicate", "{root}/models/m.gguf"), ()),
        (("--frobnicate", "plain", "--temp", "-1", "--alias", "x"), ()),
        (("--frobnicate", "https://example.com/x"), ("--frobnicate",)),
        (("--frobnicate", "/etc/passwd"), ("--frobnicate",)),
        (("--log-file", "/var/log/llama.log"), ("--log-file",)),
        (("-mmu", "https://example.com/p.gguf"), ("--mmproj-url",)),
    ],
)  # fmt: skip
def test_the_backstop_passes_paths_under_the_roots_and_allowed_flags(
    roots: Path, args: tuple[str, ...], allow: tuple[str, ...]
) -> None:
    given = tuple(a.format(root=roots) for a in args)
    policy = _policy(roots, allow_args=frozenset(allow))
    found = check_start(_request(roots, extra_args=given), policy, resolve=os.path.realpath)
    assert found is None, found


@pytest.mark.parametrize(
    ("engine", "args", "words"),
    [
        ("vllm", ("--worker-cls", "my.Worker"), "--worker-cls is refused"),
        ("vllm", ("--worker-extension-cls=my.Ext",), "--worker-extension-cls is refused"),
        ("vllm", ("--logits-processors", "my.Proc"), "--logits-processors is refused"),
        ("vllm", ("--reasoning-parser-plugin", "x.py"), "--reasoning-parser-plugin is refused"),
        ("vllm", ("--speculative-config", '{{"model": "/etc"}}'), "--speculative-config is"),
        ("sglang", ("--custom-weight-loader", "my.load"), "--custom-weight-loader is refused"),
        ("vllm", ("--generation-config", "{outside}"), "is outside the model roots"),
        ("vllm", ("--hf-config-path", "{outside}"), "is outside the model roots"),
    ],
)  # fmt: skip
def test_vllm_and_sglang_flags_that_load_code_or_read_files(
    roots: Path, engine: str, args: tuple[str, ...], words: str
) -> None:
    given = tuple(a.format(outside=roots / "outside") for a in args)
    request = _request(roots, engine=engine, extra_args=given)
    found = check_start(request, _policy(roots), resolve=os.path.realpath)
    assert found is not None and found.rule == "engine_args", found
    assert words in found.message, found.message


def test_the_summary_names_allowed_and_refused_args() -> None:
    default = AgentPolicy(model_roots=(Path("/m"),))
    assert "allow_args" not in default.summary() and "refuse_args" not in default.summary()
    loose = replace(default, allow_args=frozenset({"--trust-remote-code", "--log-file"}),
                    refuse_args=frozenset({"--props"}))  # fmt: skip
    assert loose.summary() == (
        f"{default.summary()}; allow_args: --log-file, --trust-remote-code; refuse_args: --props"
    )


# -- reading ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"colour": "red"}, "unknown policy key 'colour'"),
        ({"engines": ["llamacpp", "ollama"]}, "engines: unknown engine 'ollama'"),
        ({"images": "vllm/*"}, None),
        ({"images": [1]}, "images: expected a list of strings"),
        ({"model_roots": ["models"]}, "model_roots: 'models' is not an absolute path"),
        ({"gpus": "all"}, None),
        ({"gpus": [0, -1]}, "gpus: expected 'all' or a list of GPU indexes"),
        ({"gpus": "0,x"}, "gpus: expected 'all' or GPU indexes"),
        # A flag the table does not know may be allowed: it lets that flag take a URL or a
        # path outside the roots past the backstop (check_unknown_values).
        ({"allow_args": ["--frobnicate"]}, None),
        ({"refuse_args": ["props"]}, "refuse_args: 'props' is not a flag"),
        ({"model_roots": ""}, "model_roots: an empty value names nothing"),
        ({"model_roots": " "}, "model_roots: an empty value names nothing"),
        ({"gpus": ""}, "gpus: an empty value names nothing"),
        ({"model_roots": []}, None),
        ({"images": ["a@sha256:zz"]}, "images: 'a@sha256:zz': a digest is sha256: and 64"),
        ({"images": ["a@md5:" + "0" * 64]}, "a digest is sha256: and 64"),
        ({"images": ["a@sha256:" + "0f" * 32]}, None),
    ],
)
def test_policy_fields_are_checked(fields: dict[str, object], words: str | None) -> None:
    if words is None:
        policy_from_fields(fields, AgentPolicy())
        return
    with pytest.raises(PolicyFormatError, match=words):
        policy_from_fields(fields, AgentPolicy())


def test_agent_yaml_policy_over_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    base = default_agent_policy(tmp_path / "models", {"HF_HOME": "/srv/hf"})
    assert base.model_roots == (tmp_path / "models", Path("/srv/hf/hub"))
    assert policy_from_document({"node_id": "n"}, path=path, base=base) == base
    read = policy_from_document({"policy": {"gpus": [1, 0]}}, path=path, base=base)
    assert read == replace(base, gpus=(0, 1))
    with pytest.raises(ConfigError) as malformed:
        policy_from_document({"policy": ["engines"]}, path=path, base=base)
    assert str(malformed.value) == f"{path}: policy: expected a mapping of policy keys"


def test_a_yaml_syntax_error_in_agent_yaml_names_the_line_and_says_to_fix_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node_id: n\npolicy:\n  model_roots: [/data/models\n  gpus: all\n")
    with pytest.raises(ConfigError) as bad:
        read_agent_document(path)
    text = str(bad.value)
    assert text.startswith(f"{path}:4: invalid YAML"), text
    assert "fix the file" in text and "register" not in text.replace("registering again", "")


def test_the_leaders_agent_policy_settings(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "home")
    env = {"BERTH_POLICY_MODEL_ROOTS": "/data/models, /srv/hf", "BERTH_POLICY_GPUS": "1",
           "HOME": "/home/u"}  # fmt: skip
    policy = Settings.load(home, env=env).agent_policy({"HOME": "/home/u"})
    assert policy.model_roots == (Path("/data/models"), Path("/srv/hf"))
    assert policy.gpus == (1,)
    default = Settings.load(home, env={}).agent_policy({"HOME": "/home/u"})
    assert default.model_roots == (home.models_dir, Path("/home/u/.cache/huggingface/hub"))
    with pytest.raises(ConfigError) as bad:
        Settings.load(home, env={"BERTH_POLICY_ENGINES": "llamacpp,tgi"})
    assert "BERTH_POLICY_ENGINES" in str(bad.value) and "unknown engine 'tgi'" in str(bad.value)


def test_toml_arrays_give_the_policy_settings_and_empty_values_are_refused(
    tmp_path: Path,
) -> None:
    home = BerthHome(tmp_path / "home")
    home.root.mkdir()
    home.config_file.write_text(
        '[agent_policy]\npolicy_model_roots = ["/data/models", "/srv/hf"]\n'
        'policy_gpus = [0, 2]\npolicy_allow_args = ["--trust-remote-code"]\n'
    )
    policy = Settings.load(home, env={}).agent_policy({"HOME": "/home/u"})
    assert policy.model_roots == (Path("/data/models"), Path("/srv/hf"))
    assert policy.gpus == (0, 2)
    assert policy.allow_args == frozenset({"--trust-remote-code"})
    for text, words in [
        ('policy_model_roots = ""', "an empty value names nothing"),
        ("policy_model_roots = []", "an empty list"),
        ('policy_images = ["a@sha256:zz"]', "a digest is sha256: and 64"),
        ('policy_model_roots = ["/a,/b"]', "must not hold a comma"),
    ]:
        home.config_file.write_text(f"[agent_policy]\n{text}\n")
        with pytest.raises(ConfigError) as bad:
            Settings.load(home, env={})
        assert words in str(bad.value), (text, str(bad.value))


# -- the agent core -----------------------------------------------------------------------------


async def test_the_agent_core_refuses_before_anything_starts(roots: Path) -> None:
    core = AgentCore(
        ProcessRuntime(),
        EngineBinaries(llama_server=None, vllm=None, sglang_python=""),
        StaticInventory(),
        logs_dir=roots / "logs",
        policy=_policy(roots),
    )
    try:
        request = _request(roots, extra_args=("--log-file=/tmp/x",))
        with pytest.raises(PolicyError) as refused:
            await core.start(request, health_timeout_s=5.0)
        assert refused.value.rule == "engine_args"
        assert core.engines() == []
        assert not (roots / "engine-keys").exists()  # no key file written either
    finally:
        core.close()


# -- placement ----------------------------------------------------------------------------------

MODEL = ModelRecord(
    "m", Path("/srv/models/m.gguf"), "local", None, None, 0, datetime(2026, 1, 1, tzinfo=UTC)
)


def _node(node_id: str, policy: AgentPolicy | None, *gpus: GpuFacts) -> NodeFacts:
    return NodeFacts(node_id, f"gpu-{node_id}", connected=True,
                     runtimes=frozenset({"process", "docker"}),
                     model_location=Path("/srv/models/m.gguf"), gpus=gpus,
                     policy=policy)  # fmt: skip


def _gpu(index: int) -> GpuFacts:
    return GpuFacts(index, "L4", 24_000, 24_000, ())


ESTIMATE = VramEstimate(
    engine="llamacpp", weights_mb=10_000, kv_cache_mb=0, overhead_mb=0, gpu_count=1, ctx=4096,
    cache_type="f16", budget_fraction=None, budget_flag=None, holds_fraction=None, inputs=(),
)  # fmt: skip


def test_placement_by_fit_skips_a_refusing_node_and_keeps_to_the_gpus_handed_out() -> None:
    request = PlacementRequest(MODEL, "vllm", "process", estimate=ESTIMATE,
                               extra_args=("--trust-remote-code",))  # fmt: skip
    lenient = AgentPolicy(model_roots=(Path("/srv"),), gpus=(1,),
                          allow_args=frozenset({"--trust-remote-code"}))  # fmt: skip
    strict = AgentPolicy(model_roots=(Path("/srv"),))
    nodes = [_node("a", strict, _gpu(0)), _node("b", lenient, _gpu(0), _gpu(1))]
    placed = plan_placement(request, nodes)
    assert isinstance(placed, Placement)
    assert (placed.node_id, placed.gpus) == ("b", (1,))
    assert placed.reasons[0] == (
        "left out: node gpu-a refuses it by its policy (engine_args): extra argument "
        "--trust-remote-code is refused: it runs the Python code shipped in the model folder "
        "(allow it on this host with allow_args: [--trust-remote-code])"
    )
    refused = plan_placement(request, nodes[:1])
    assert isinstance(refused, Refusal) and refused.reason == "no_node"
    assert "node gpu-a refuses it by its policy (engine_args)" in refused.message


def test_placement_leaves_out_a_node_whose_policy_refuses_and_says_why() -> None:
    strict = AgentPolicy(model_roots=(Path("/srv/models"),), images=("vllm/*",))
    request = PlacementRequest(MODEL, "llamacpp", "docker", "a", image="evil/miner:1")
    refused = plan_placement(request, [_node("a", strict)], PlacementPolicy())
    assert isinstance(refused, Refusal)
    assert refused.reason == "node_policy"
    assert refused.message == (
        "node gpu-a refuses it by its policy (images): image evil/miner:1 is not allowed "
        "(images: vllm/*)"
    )
    error = refused.error()
    assert (type(error).__name__, getattr(error, "rule", None)) == ("PolicyError", "images")
    # The test seam: the leader skips its check and sends it to the agent.
    skipped = plan_placement(request, [_node("a", strict)], PlacementPolicy(False))
    assert isinstance(skipped, Placement)


def test_placement_checks_arguments_and_the_model_path_on_each_node() -> None:
    elsewhere = AgentPolicy(model_roots=(Path("/data"),))
    request = PlacementRequest(MODEL, "vllm", "process", "a",
                               extra_args=("--trust-remote-code",))  # fmt: skip
    inside = AgentPolicy(model_roots=(Path("/srv/models"),))
    found = plan_placement(request, [_node("a", inside)])
    assert isinstance(found, Refusal) and "(engine_args): extra argument --trust" in found.message
    found = plan_placement(replace(request, extra_args=()), [_node("a", elsewhere)])
    assert isinstance(found, Refusal)
    assert found.message == (
        "node gpu-a refuses it by its policy (model_roots): model path /srv/models/m.gguf is "
        "outside the model roots (/data)"
    )
    assert isinstance(plan_placement(replace(request, extra_args=()), [_node("a", inside)]),
                      Placement)  # fmt: skip
    # An agent from before policies reports none: nothing is checked at the leader.
    assert isinstance(plan_placement(request, [_node("a", None)]), Placement)


def test_on_the_leaders_own_node_placement_resolves_symlinks(roots: Path) -> None:
    (roots / "models" / "link").symlink_to(roots / "outside")
    template = roots / "models" / "link" / "secret.txt"
    model = roots / "models" / "m.gguf"
    request = PlacementRequest(replace(MODEL, path=model), "llamacpp", "process", "local",
                               extra_args=("--chat-template-file", str(template)))  # fmt: skip
    policy = AgentPolicy(model_roots=(roots / "models",))
    local = replace(_node("local", policy), leader_host=True, model_location=model)
    found = plan_placement(request, [local])
    assert isinstance(found, Refusal), found
    assert "(engine_args): extra argument --chat-template-file" in found.message
    # The leader cannot see another host's links: that host's agent refuses at the start.
    remote = replace(_node("a", policy), model_location=model)
    assert isinstance(plan_placement(replace(request, node_id="a"), [remote]), Placement)


def test_an_adapter_to_load_must_lie_under_the_roots(roots: Path) -> None:
    enforce_path("adapter path", str(roots / "models" / "m.gguf"), _policy(roots))
    with pytest.raises(PolicyError) as refused:
        enforce_path("adapter path", str(roots / "outside" / "secret.txt"), _policy(roots))
    assert refused.value.rule == "model_roots"
    assert str(refused.value).startswith("refused by the agent policy (model_roots): adapter path")


def test_a_link_in_the_model_folder_that_leaves_the_roots_is_refused(roots: Path) -> None:
    folder = roots / "models" / "hf-model"
    folder.mkdir()
    (folder / "config.json").symlink_to(roots / "outside" / "secret.txt")
    with pytest.raises(PolicyError) as refused:
        enforce_start(_request(roots, engine="vllm", model_path=folder), _policy(roots))
    assert refused.value.rule == "model_roots"
    assert f"model file {folder / 'config.json'} (a link to {roots}/outside/secret.txt)" in str(
        refused.value
    )
    (folder / "config.json").unlink()
    (roots / "models" / "blob").write_text("{}")
    (folder / "config.json").symlink_to("../blob")  # as a Hugging Face snapshot links
    enforce_start(_request(roots, engine="vllm", model_path=folder), _policy(roots))


def test_the_api_view_of_a_policy_is_its_wire_form_and_summary(tmp_path: Path) -> None:
    """``GET /admin/nodes/{id}``'s policy: every field as the agent reports it, and the
    summary ``berth nodes show`` prints."""
    from berth.admin.nodes import policy_view
    from berth.cluster.protocol.payloads import policy_state
    from berth.vocab.agent_policy import default_agent_policy

    policy = default_agent_policy(tmp_path / "models", {})
    view = policy_view(policy)
    assert view.model_dump(exclude={"summary"}) == msgspec.structs.asdict(policy_state(policy))
    assert view.summary == policy.summary()
    assert str(tmp_path / "models") in view.model_roots
