"""Version skew: the previous release's agent against this leader (docs/versions.md).

The support rule: an agent one minor version behind the leader enrolls, serves and streams;
what it lacks (the capabilities it does not advertise in its Hello) the leader leaves off for
that node. This test takes the previous release's source from git (its tag, or the commit
``PREVIOUS_RELEASE`` names when tags were not cloned), puts it in a virtual environment of its
own (the current environment's packages beneath it, since the dependencies it pins are the
same), and runs it as an agent against a leader built from this tree: it registers with an
enrollment URI this leader printed, reports ready, starts an engine and serves a streamed
chat completion through the tunnel.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import tarfile
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.cluster_harness import URI_PATTERN, Agent, Cluster, started_cluster

pytestmark = pytest.mark.slow

#: The release before this tree's version, and its commit (used where the tag is absent).
PREVIOUS_RELEASE = ("v0.1.0", "babd4d7")
REPO = Path(__file__).resolve().parent.parent


def _previous_source(dest: Path) -> Path:
    """The previous release's ``src/`` unpacked under ``dest``; skips where this checkout
    has no git history to take it from (a source tarball, a shallow clone)."""
    tag, commit = PREVIOUS_RELEASE
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("no git history in this checkout: the previous release cannot be read")
    for ref in (f"{tag}^{{commit}}", commit):
        found = subprocess.run([git, "-C", str(REPO), "rev-parse", "--verify", "-q", ref],
                               capture_output=True, text=True)  # fmt: skip
        if found.returncode == 0:
            break
    else:
        pytest.skip(f"neither {tag} nor {commit} is in this clone's history")
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "previous.tar"
    subprocess.run([git, "-C", str(REPO), "archive", "-o", str(archive), ref, "src"],
                   check=True)  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / "src"


def _previous_venv(root: Path) -> Path:
    """A virtual environment whose ``berth`` is the previous release: its source first on
    the path (a ``.pth`` file), this environment's site-packages after it for the
    dependencies. Returns its python."""
    source = _previous_source(root)
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "previous_berth.pth").write_text("\n".join([str(source), *ours]) + "\n")
    return python


@pytest.fixture(scope="module")
def skewed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    root = tmp_path_factory.mktemp("skew")
    python = _previous_venv(root / "previous")
    with started_cluster(root) as cluster:
        yield cluster, python


def _run_previous(python: Path, home: Path, *args: str, env: dict[str, str]) -> str:
    clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(python), "-m", "berth", "--home", str(home), *args],
                            capture_output=True, text=True, env=clean, timeout=120,
                            cwd=home.parent)  # fmt: skip
    assert result.returncode == 0, f"previous berth {args}: {result.stdout}\n{result.stderr}"
    return result.stdout


def test_the_previous_release_is_what_runs(skewed_cluster: tuple[Cluster, Path]) -> None:
    _, python = skewed_cluster
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import berth; print(berth.__file__)"],
                           capture_output=True, text=True, check=True, env=env)  # fmt: skip
    assert "previous" in where.stdout and str(REPO / "src") not in where.stdout, where.stdout


@pytest.fixture(scope="module")
def old_agent(skewed_cluster: tuple[Cluster, Path]) -> Agent:
    """The previous release's agent, registered with an enrollment URI this leader printed,
    ready, with ``skew-model`` deployed on its node."""
    cluster, python = skewed_cluster
    printed = cluster.berth("nodes", "enroll", "old").stdout
    uri = URI_PATTERN.search(printed)
    assert uri, printed
    home = cluster.root / "agent-old"
    home.mkdir()
    _run_previous(python, home, "agent", "register", "--uri", uri.group(0), env=cluster.env)
    node_id = next(line.split(":", 1)[1].strip().strip("'\"")
                   for line in (home / "agent.yaml").read_text().splitlines()
                   if line.startswith("node_id:"))  # fmt: skip
    agent = Agent("old", home, node_id)
    cluster.agents["old"] = agent
    env = {k: v for k, v in cluster.env.items() if k != "PYTHONPATH"}
    with (home / "agent.out").open("ab") as log:
        agent.process = subprocess.Popen(
            [str(python), "-m", "berth", "--home", str(home), "agent", "start", "--verbose"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=home, start_new_session=True,
        )  # fmt: skip
    cluster.wait_node(node_id, "ready")
    cluster.deploy("skew-model", cluster.root / "tiny.gguf", agent)
    return agent


def test_a_previous_release_agent_serves_a_stream_through_the_tunnel(
    skewed_cluster: tuple[Cluster, Path], old_agent: Agent
) -> None:
    cluster, _ = skewed_cluster
    with cluster.openai() as client:
        stream = client.chat.completions.create(
            model="skew-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text, "the stream through the previous release's agent was empty"
    served = cluster.node(old_agent.node_id)
    assert served["status"] == "ready", served


def test_what_the_previous_agent_lacks_is_named(
    skewed_cluster: tuple[Cluster, Path], old_agent: Agent
) -> None:
    # v0.1.0's agent does not read model headers for the leader (op.model_shape came after):
    # the model's copy on its node says so, naming the capability, instead of failing.
    cluster, _ = skewed_cluster
    shown = cluster.berth("models", "show", "skew-model").stdout
    assert "node old's agent does not read model headers (no op.model_shape)" in shown, shown
