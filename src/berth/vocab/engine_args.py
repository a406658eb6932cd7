"""The engine arguments an agent policy refuses by default: the one table of them, each
entry with the engine documentation it came from.

An entry is :class:`EngineArg`: the flag's spellings, the engines that read it, and what
the policy does with it (:data:`ArgRule`):

* ``refused``: never given (it loads code, or reads or writes files the operator did not
  choose), unless the host's policy allows it by name (``allow_args``);
* ``path``: its value is a file or folder the engine reads; it must lie under one of the
  policy's model roots once symlinks and ``..`` are resolved (a relative path is refused:
  the engine's working folder is not the agent's to promise);
* ``path_or_repo``: as ``path`` when the value looks like a path (``/``, ``.`` or ``~``
  first); any other value is a Hugging Face repository id (downloaded into the Hugging Face
  cache, a model root by default);
* ``path_or_template``: a value holding ``{`` is an inline Jinja template; any other is a
  path, as ``path``.

Both spellings of a flag with a value are read: ``--flag VALUE`` and ``--flag=VALUE``
(:func:`flag_values`).  vLLM and SGLang parse their flags with Python's ``argparse``, which
takes an unambiguous prefix of a flag for the flag (``--trust-remote`` for
``--trust-remote-code``), and vLLM reads ``_`` as ``-`` in a flag's name; so for them a
flag is compared with ``_`` read as ``-`` and a prefix of a flag of the table counts as it.

Sources, read in December 2026:

* llama.cpp: ``llama-server --help`` of the build in berth's ``.venv`` (0.6.0-dev), the
  same text as ``tools/server/README.md`` in ggml-org/llama.cpp;
* vLLM: the ``vllm serve`` CLI reference ("Engine Arguments" and "OpenAI-Compatible
  Server" pages of docs.vllm.ai; mirrored in Red Hat AI Inference Server's "vLLM server
  arguments");
* SGLang: the "Server Arguments" page of docs.sglang.ai.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from berth.vocab.engines import ENGINE_NAMES, EngineName

ArgRule = Literal["refused", "path", "path_or_repo", "path_or_template"]

_ALL: frozenset[EngineName] = frozenset(ENGINE_NAMES)
_LLAMACPP: frozenset[EngineName] = frozenset({"llamacpp"})
_VLLM: frozenset[EngineName] = frozenset({"vllm"})
_SGLANG: frozenset[EngineName] = frozenset({"sglang"})
_PYTHON: frozenset[EngineName] = frozenset({"vllm", "sglang"})

_LLAMA_HELP = "llama-server --help"

#: llama-server's preset flags, each a model it downloads from Hugging Face ("can download
#: weights from the internet" in its help).
_LLAMA_PRESETS: tuple[str, ...] = (
    "--embd-gemma-default",
    "--fim-qwen-1.5b-default",
    "--fim-qwen-3b-default",
    "--fim-qwen-7b-default",
    "--fim-qwen-7b-spec",
    "--fim-qwen-14b-spec",
    "--fim-qwen-30b-default",
    "--gpt-oss-20b-default",
    "--gpt-oss-120b-default",
    "--vision-gemma-4b-default",
    "--vision-gemma-12b-default",
)
_VLLM_DOCS = "vllm serve reference (docs.vllm.ai)"
_SGLANG_DOCS = "SGLang Server Arguments (docs.sglang.ai)"


@dataclass(frozen=True)
class EngineArg:
    """One entry of :data:`ENGINE_ARGS`: ``flags`` are every spelling (the first is the
    name the policy uses), ``engines`` those that read it, ``rule`` what the policy does,
    ``takes_value`` whether a value follows, ``comma_list`` whether that value is a comma
    list of paths, ``scaled`` whether each item of it is ``FNAME:SCALE`` (the path is the
    part before the last ``:``), ``why`` the reason shown in a refusal, ``source`` the docs
    it came from."""

    flags: tuple[str, ...]
    engines: frozenset[EngineName]
    rule: ArgRule
    why: str
    source: str
    takes_value: bool = True
    comma_list: bool = False
    scaled: bool = False

    @property
    def name(self) -> str:
        return self.flags[0]


def _refused(
    flags: tuple[str, ...],
    engines: frozenset[EngineName],
    why: str,
    source: str,
    *,
    takes_value: bool = True,
) -> EngineArg:
    return EngineArg(flags, engines, "refused", why, source, takes_value=takes_value)


def _path(
    flags: tuple[str, ...],
    engines: frozenset[EngineName],
    why: str,
    source: str,
    *,
    rule: ArgRule = "path",
    comma_list: bool = False,
    scaled: bool = False,
) -> EngineArg:
    return EngineArg(
        flags, engines, rule, why, source, comma_list=comma_list or scaled, scaled=scaled
    )


#: The table.  Order is display order: code loading first, then files written, then files
#: read.
ENGINE_ARGS: tuple[EngineArg, ...] = (
    # -- loads code
    _refused(("--trust-remote-code",), _PYTHON,
             "runs the Python code shipped in the model folder", f"{_VLLM_DOCS}; {_SGLANG_DOCS}",
             takes_value=False),
    _refused(("--middleware",), _VLLM, "imports a Python class into the server", _VLLM_DOCS),
    _refused(("--config",), _VLLM,
             "reads more flags from a file, where the policy cannot see them", _VLLM_DOCS),
    _refused(("--tool-parser-plugin",), _VLLM, "runs a Python file as a tool parser",
             _VLLM_DOCS),
    _refused(("--worker-cls",), _VLLM, "imports a Python class as the engine's worker",
             _VLLM_DOCS),
    _refused(("--worker-extension-cls",), _VLLM, "imports a Python class into the worker",
             _VLLM_DOCS),
    _refused(("--logits-processors",), _VLLM, "imports Python logits processors", _VLLM_DOCS),
    _refused(("--logits-processor-pattern",), _VLLM,
             "lets requests name Python logits processors to import", _VLLM_DOCS),
    _refused(("--reasoning-parser-plugin",), _VLLM, "runs a Python file as a reasoning parser",
             _VLLM_DOCS),
    _refused(("--speculative-config",), _VLLM,
             "names a draft model (a path or a repository) in JSON the policy does not read",
             _VLLM_DOCS),
    _refused(("--custom-weight-loader",), _SGLANG, "imports Python functions to load weights",
             _SGLANG_DOCS),
    _refused(("--enable-custom-logit-processor",), _SGLANG,
             "lets requests send Python logit processors to run", _SGLANG_DOCS,
             takes_value=False),
    _refused(("--tools",), _LLAMACPP,
             "built-in agent tools that read and write files and run shell commands",
             _LLAMA_HELP),
    _refused(("--agent", "-ag"), _LLAMACPP, "turns on every built-in agent tool", _LLAMA_HELP,
             takes_value=False),
    _refused(("--tools-runtime",), _LLAMACPP, "runs the agent tools in containers or over SSH",
             _LLAMA_HELP),
    _refused(("--mcp-servers-config",), _LLAMACPP, "starts the MCP servers a file names",
             _LLAMA_HELP),
    _refused(("--mcp-servers-json",), _LLAMACPP, "starts the MCP servers it names", _LLAMA_HELP),
    # -- writes files, or downloads into places berth does not choose
    _refused(("--log-file",), _LLAMACPP, "writes to any file", _LLAMA_HELP),
    _refused(("--slot-save-path",), _LLAMACPP, "writes KV-cache files into any folder",
             _LLAMA_HELP),
    _refused(("--log-prompts-dir",), _LLAMACPP, "writes every prompt into any folder",
             _LLAMA_HELP),
    _refused(("--lookup-cache-dynamic", "-lcd"), _LLAMACPP, "writes a cache file anywhere",
             _LLAMA_HELP),
    _refused(("--model-url", "-mu"), _LLAMACPP, "downloads a model from any URL", _LLAMA_HELP),
    _refused(("--mmproj-url", "-mmu"), _LLAMACPP,
             "downloads a multimodal projector from any URL", _LLAMA_HELP),
    _refused(("--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"), _LLAMACPP,
             "downloads a draft model berth did not place", _LLAMA_HELP),
    _refused(_LLAMA_PRESETS, _LLAMACPP,
             "downloads a preset model berth did not place", _LLAMA_HELP, takes_value=False),
    _refused(("--hf-repo", "-hf", "-hfr"), _LLAMACPP,
             "downloads a model berth did not place (berth models pull does)", _LLAMA_HELP),
    _refused(("--docker-repo", "-dr"), _LLAMACPP, "downloads a model from Docker Hub",
             _LLAMA_HELP),
    _refused(("--download-dir",), _PYTHON, "downloads weights into any folder",
             f"{_VLLM_DOCS}; {_SGLANG_DOCS}"),
    # -- reaches other hosts, or runs programs
    _refused(("--rpc",), _LLAMACPP,
             "sends the model and every prompt to the RPC servers it names", _LLAMA_HELP),
    _refused(("--video-ffmpeg-dir",), _LLAMACPP, "runs ffmpeg and ffprobe from any folder",
             _LLAMA_HELP),
    # -- sets what berth sets itself (the engine listens on 127.0.0.1 at berth's port)
    _refused(("--host",), _ALL,
             "sets the address berth gives the engine (127.0.0.1), or a UNIX socket anywhere",
             f"{_LLAMA_HELP}; {_VLLM_DOCS}; {_SGLANG_DOCS}"),
    _refused(("--port",), _ALL, "sets the port berth gives the engine",
             f"{_LLAMA_HELP}; {_VLLM_DOCS}; {_SGLANG_DOCS}"),
    _refused(("--uds",), _VLLM, "listens on a UNIX socket anywhere instead of berth's port",
             _VLLM_DOCS),
    # -- reads files, or serves them
    _refused(("--path",), _LLAMACPP, "serves any folder as static files", _LLAMA_HELP),
    _refused(("--media-path",), _LLAMACPP, "lets requests read local files by file:// URL",
             _LLAMA_HELP),
    _refused(("--allowed-local-media-path",), _VLLM,
             "lets requests read local files by file:// URL", _VLLM_DOCS),
    _refused(("--models-dir",), _LLAMACPP, "loads any model of a folder (router mode)",
             _LLAMA_HELP),
    _refused(("--models-preset",), _LLAMACPP, "reads model presets from any file", _LLAMA_HELP),
    _refused(("--api-key-file",), _LLAMACPP, "berth gives the engine its key itself",
             _LLAMA_HELP),
    _refused(("--lora-modules",), _VLLM,
             "loads adapters from any path (berth loads adapters itself: berth adapters)",
             _VLLM_DOCS),
    _path(("--chat-template-file",), _LLAMACPP, "reads a chat template", _LLAMA_HELP),
    _path(("--chat-template",), _PYTHON, "reads a chat template when given a path",
          f"{_VLLM_DOCS}; {_SGLANG_DOCS}", rule="path_or_template"),
    _path(("--tokenizer",), _VLLM, "reads a tokenizer when given a path", _VLLM_DOCS,
          rule="path_or_repo"),
    _path(("--tokenizer-path",), _SGLANG, "reads a tokenizer when given a path", _SGLANG_DOCS,
          rule="path_or_repo"),
    _path(("--model", "-m"), _LLAMACPP, "reads a model", _LLAMA_HELP),
    _path(("--model",), _VLLM, "reads a model when given a path", _VLLM_DOCS, rule="path_or_repo"),
    _path(("--generation-config",), _VLLM, "reads generation defaults when given a folder",
          _VLLM_DOCS, rule="path_or_repo"),
    _path(("--hf-config-path",), _VLLM, "reads a model configuration when given a path",
          _VLLM_DOCS, rule="path_or_repo"),
    _path(("--model-path",), _SGLANG, "reads a model when given a path", _SGLANG_DOCS,
          rule="path_or_repo"),
    _path(("--model-draft", "-md", "--spec-draft-model"), _LLAMACPP, "reads a draft model",
          _LLAMA_HELP),
    _path(("--mmproj", "-mm"), _LLAMACPP, "reads a multimodal projector", _LLAMA_HELP),
    _path(("--lora",), _LLAMACPP, "reads LoRA adapters", _LLAMA_HELP, comma_list=True),
    _path(("--lora-scaled",), _LLAMACPP, "reads LoRA adapters", _LLAMA_HELP, scaled=True),
    _path(("--control-vector",), _LLAMACPP, "reads control vectors", _LLAMA_HELP,
          comma_list=True),
    _path(("--control-vector-scaled",), _LLAMACPP, "reads control vectors", _LLAMA_HELP,
          scaled=True),
    _path(("--grammar-file",), _LLAMACPP, "reads a grammar", _LLAMA_HELP),
    _path(("--json-schema-file", "-jf"), _LLAMACPP, "reads a JSON schema", _LLAMA_HELP),
    _path(("--lookup-cache-static", "-lcs"), _LLAMACPP, "reads a lookup cache", _LLAMA_HELP),
    _path(("--ui-config-file", "--webui-config-file"), _LLAMACPP, "reads UI settings",
          _LLAMA_HELP),
    _path(("--ssl-key-file",), _LLAMACPP, "reads a private key", _LLAMA_HELP),
    _path(("--ssl-cert-file",), _LLAMACPP, "reads a certificate", _LLAMA_HELP),
    _path(("--ssl-keyfile",), _PYTHON, "reads a private key", f"{_VLLM_DOCS}; {_SGLANG_DOCS}"),
    _path(("--ssl-certfile",), _PYTHON, "reads a certificate", f"{_VLLM_DOCS}; {_SGLANG_DOCS}"),
    _path(("--ssl-ca-certs",), _VLLM, "reads CA certificates", _VLLM_DOCS),
)  # fmt: skip

#: Every flag name the table knows (any spelling), for checking a policy's ``allow_args``.
KNOWN_FLAGS: frozenset[str] = frozenset(flag for entry in ENGINE_ARGS for flag in entry.flags)


def entries_for(engine: EngineName) -> Iterator[EngineArg]:
    """The table's entries ``engine`` reads, in table order."""
    return (entry for entry in ENGINE_ARGS if engine in entry.engines)


@dataclass(frozen=True)
class GivenFlag:
    """A flag found in a command line: its spelling as given and its value (``None``:
    none given, or the flag takes none)."""

    flag: str
    value: str | None


def flag_values(
    args: Sequence[str], flags: frozenset[str], *, takes_value: bool, argparse: bool = False
) -> list[GivenFlag]:
    """Each occurrence in ``args`` of a flag among ``flags``, as ``--flag VALUE`` or
    ``--flag=VALUE`` (for a flag that ``takes_value``; a trailing one has value ``None``).
    With ``argparse`` (vLLM, SGLang), ``_`` in a given flag reads as ``-`` and a long flag
    that is a prefix of one of ``flags`` counts as it."""
    found: list[GivenFlag] = []
    index = 0
    while index < len(args):
        arg = args[index]
        flag, equals, inline = arg.partition("=")
        if _matches(flag, flags, argparse=argparse):
            if equals:
                found.append(GivenFlag(flag, inline))
            elif takes_value and index + 1 < len(args):
                found.append(GivenFlag(flag, args[index + 1]))
                index += 1
            else:
                found.append(GivenFlag(flag, None))
        index += 1
    return found


def _matches(flag: str, flags: frozenset[str], *, argparse: bool) -> bool:
    if flag in flags:
        return True
    if not argparse or not flag.startswith("--") or len(flag) < 4:
        return False
    name = flag.replace("_", "-")
    return any(known.startswith(name) for known in flags if known.startswith("--"))


def uses_argparse(engine: EngineName) -> bool:
    """Whether ``engine`` parses its flags with Python's ``argparse`` (vLLM, SGLang)."""
    return engine in _PYTHON


def names_a_path(rule: ArgRule, value: str) -> bool:
    """Whether ``value``, given to a flag of ``rule``, names a file or folder on the host
    (see the module docstring); ``refused`` flags name none."""
    if rule == "path":
        return True
    if rule == "path_or_repo":
        return value.startswith(("/", ".", "~"))
    if rule == "path_or_template":
        return "{" not in value
    return False
