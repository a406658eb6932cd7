"""``berth pull`` against a real HTTP stand-in of the Hugging Face hub on loopback."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from berth.errors import BerthError, ConfigError, NotFoundError
from berth.runtime.engines import find_free_port
from berth.runtime.hf_pull import HubFile, model_dirname, pull_model, resolve_endpoint
from support.hub_standin import TINY_FILES, HubStandin

REPO = "berth-test/tiny-model"
FILES = TINY_FILES  # REPO and these files: the shared hub fixture (conftest.py)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "hf-cache"


def test_pull_puts_every_file_in_the_models_dir(
    hub: HubStandin, tmp_path: Path, cache_dir: Path
) -> None:
    models_dir = tmp_path / "models"

    local = pull_model(
        REPO, models_dir=models_dir, endpoint=hub.url, progress=False, cache_dir=cache_dir
    )

    assert local == (models_dir / "berth-test--tiny-model").resolve()
    for name, data in FILES.items():
        assert (local / name).read_bytes() == data
    assert ("GET", f"/{REPO}/resolve/{_commit(hub)}/tiny.gguf") in hub.requests


def test_pull_again_downloads_nothing_new(hub: HubStandin, tmp_path: Path, cache_dir: Path) -> None:
    models_dir = tmp_path / "models"
    pull_model(REPO, models_dir=models_dir, endpoint=hub.url, progress=False, cache_dir=cache_dir)
    hub.requests.clear()

    pull_model(REPO, models_dir=models_dir, endpoint=hub.url, progress=False, cache_dir=cache_dir)

    assert not [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]


def test_pull_reads_the_endpoint_from_hf_endpoint(
    hub: HubStandin, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url + "/")

    local = pull_model(
        REPO,
        models_dir=tmp_path,
        progress=False,
        dir_name="tiny",
        cache_dir=cache_dir,
    )

    assert local == (tmp_path / "tiny").resolve()
    assert (local / "tiny.gguf").read_bytes() == FILES["tiny.gguf"]


def test_pull_by_commit_and_with_progress_bars(
    hub: HubStandin, tmp_path: Path, cache_dir: Path
) -> None:
    hub.requests.clear()  # the hub serves the whole module
    local = pull_model(
        REPO,
        revision=_commit(hub),
        models_dir=tmp_path,
        endpoint=hub.url,
        progress=True,
        cache_dir=cache_dir,
    )

    assert (local / "config.json").read_bytes() == FILES["config.json"]
    # A commit id needs no revision lookup.
    assert not [path for _, path in hub.requests if "/revision/" in path]


def test_unknown_repository_is_not_found(hub: HubStandin, tmp_path: Path, cache_dir: Path) -> None:
    with pytest.raises(NotFoundError) as caught:
        pull_model(
            "berth-test/missing",
            models_dir=tmp_path,
            endpoint=hub.url,
            progress=False,
            cache_dir=cache_dir,
        )

    assert str(caught.value) == "hub repository 'berth-test/missing' not found"


def test_unknown_revision_is_not_found(hub: HubStandin, tmp_path: Path, cache_dir: Path) -> None:
    with pytest.raises(NotFoundError) as caught:
        pull_model(
            REPO,
            revision="v9",
            models_dir=tmp_path,
            endpoint=hub.url,
            progress=False,
            cache_dir=cache_dir,
        )

    assert caught.value.kind == "revision"
    assert "berth-test/tiny-model@v9" in str(caught.value)


def test_unreachable_hub_is_a_one_line_error(tmp_path: Path, cache_dir: Path) -> None:
    closed = f"http://127.0.0.1:{find_free_port()}"

    with pytest.raises(BerthError) as caught:
        pull_model(REPO, models_dir=tmp_path, endpoint=closed, progress=False, cache_dir=cache_dir)

    assert not isinstance(caught.value, NotFoundError)
    assert str(caught.value) == f"cannot reach the hub at {closed} to pull {REPO}"


class _Sink:
    """A pull's progress, thrown away (the leader's pulls pass one)."""

    def listed(self, files: Sequence[HubFile]) -> None:
        pass

    def advanced(self, path: str, n_bytes: int) -> None:
        pass

    def finished(self, path: str) -> None:
        pass


def test_unreachable_hub_is_the_same_one_line_error_when_progress_is_reported(
    tmp_path: Path, cache_dir: Path
) -> None:
    closed = f"http://127.0.0.1:{find_free_port()}"

    with pytest.raises(BerthError) as caught:
        pull_model(REPO, models_dir=tmp_path, endpoint=closed, cache_dir=cache_dir, sink=_Sink())

    assert not isinstance(caught.value, NotFoundError)
    assert str(caught.value) == f"cannot reach the hub at {closed} to pull {REPO}"


@pytest.mark.parametrize("repo_id", ["a/b/c", "bad repo name", "-x/y"])
def test_malformed_repository_id_is_a_config_error(repo_id: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        pull_model(repo_id, models_dir=tmp_path, endpoint="http://127.0.0.1:9", progress=False)


@pytest.mark.parametrize("dir_name", ["../escape", "a/b", "", ".hidden"])
def test_unsafe_folder_name_is_refused(dir_name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        pull_model(REPO, models_dir=tmp_path, dir_name=dir_name, progress=False)


def test_folder_names_and_endpoint_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert model_dirname("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB--SmolLM2-135M-Instruct"
    )
    assert resolve_endpoint() == "https://huggingface.co"
    assert resolve_endpoint("http://mirror.local/") == "http://mirror.local"
    monkeypatch.setenv("HF_ENDPOINT", "http://env.local")
    assert resolve_endpoint() == "http://env.local"


def _commit(hub: HubStandin) -> str:
    repo = hub.lookup(REPO)
    assert repo is not None
    return repo.commit
