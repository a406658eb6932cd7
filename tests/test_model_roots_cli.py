"""``berth models add`` of weights outside node local's model roots: the README's steps
registered a GGUF from the current folder, then ``berth run`` was refused by the default
agent policy (``model_roots``) with nothing earlier saying so.  Now the add says so, with
the ``berth config set-policy`` command that allows the folder, and that command works.
Real CLI and daemon in the test's own home; the suite's policy variables left out, so the
policy comes from the home's ``config.toml`` as on a user's machine."""

from __future__ import annotations

import shlex
from pathlib import Path

from support.berth_cli import Berth, running_daemon
from support.cluster_harness import clean_env


def berth_for(tmp_path: Path) -> Berth:
    env = {k: v for k, v in clean_env({}).items() if k != "BERTH_POLICY_MODEL_ROOTS"}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return Berth(tmp_path / "home", env=env, cwd=cwd)


def test_weights_outside_the_roots_are_added_with_the_command_that_allows_them(
    tmp_path: Path,
) -> None:
    berth = berth_for(tmp_path)
    roots, elsewhere = tmp_path / "models", tmp_path / "elsewhere"
    for folder in (roots, elsewhere):
        folder.mkdir()
        (folder / "a.gguf").write_bytes(b"GGUF")
        (folder / "b.gguf").write_bytes(b"GGUF")
    berth("config", "set-policy", f"model_roots={roots}")

    with running_daemon(berth):
        inside = berth("models", "add", "inside", "--path", str(roots / "a.gguf"))
        outside = berth("models", "add", "outside", "--path", str(elsewhere / "a.gguf"))
        answer = berth.admin(
            "POST", "/admin/models", json={"name": "api", "path": str(elsewhere / "b.gguf")}
        )

    assert inside.stderr == ""
    assert outside.stdout.startswith("added model outside")
    allow = f"berth config set-policy model_roots={roots},{elsewhere}"
    assert outside.stderr == (
        f"warning: node local will refuse to run it: model path {elsewhere / 'a.gguf'} is "
        f"outside the model roots ({roots}); allow its folder with `{allow}`, then restart "
        "the daemon (`berth daemon stop`, `berth daemon start`)\n"
    )
    assert answer["warning"].startswith("node local will refuse to run it: model path")

    berth(*shlex.split(allow)[1:])  # the command as the warning gives it
    with running_daemon(berth):
        again = berth("models", "add", "again", "--path", str(elsewhere / "b.gguf"))
        listed = berth.admin("GET", "/admin/models")
    assert again.stderr == ""
    assert {model["warning"] for model in listed} == {None}


def test_set_policy_refuses_a_relative_root_and_an_unknown_key(tmp_path: Path) -> None:
    berth = berth_for(tmp_path)
    assert "not an absolute path" in berth.fails("config", "set-policy", "model_roots=models")
    assert berth.fails("config", "set-policy", "roots=/a") == (
        "error: unknown key 'roots'; valid keys: engines=, images=, model_roots=, gpus=, "
        "allow_args=, refuse_args="
    )
