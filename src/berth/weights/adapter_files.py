"""What a LoRA adapter on disk is, and whether it fits a base model (reads files, no engine).

Two formats, one per kind of engine:

* **PEFT** (vLLM, SGLang): a folder with ``adapter_config.json`` (PEFT's ``LoraConfig``:
  ``peft_type`` ``"LORA"``, the rank ``r``, ``target_modules``, ``base_model_name_or_path``)
  and its weights, ``adapter_model.safetensors`` (or the older ``adapter_model.bin``). The
  safetensors header (a little-endian ``uint64`` length, then JSON naming each tensor's
  ``shape``) gives each ``lora_A`` matrix's shape ``[r, in_features]``.
* **GGUF** (llama.cpp): one file written by llama.cpp's ``convert_lora_to_gguf.py``, with
  ``general.type = "adapter"``, ``adapter.type = "lora"``, the base's
  ``general.architecture``, and for each adapted weight ``W`` a pair ``W.lora_a``
  (``ne = [W.ne[0], r]``) and ``W.lora_b`` (``ne = [r, W.ne[1]]``): the shapes llama.cpp
  checks when it loads one (``src/llama-adapter.cpp``).

:func:`inspect_adapter` reads an adapter, :func:`inspect_base` what of a base model the
checks need (its GGUF header, or its ``config.json``), and :func:`check_fits` compares them,
returning every reason they do not fit, in words.
"""

from __future__ import annotations

import json
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from berth.errors import ConfigError
from berth.weights.gguf_file import GgufHeader, GgufTensor, is_gguf, read_gguf_header
from berth.weights.model_files import checked_path

AdapterFormat = Literal["peft", "gguf"]
ADAPTER_FORMATS: tuple[AdapterFormat, ...] = ("peft", "gguf")

#: The files of a PEFT adapter folder (PEFT's ``save_pretrained``).
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: Largest safetensors header read, in bytes (the format itself caps it at 100 MB).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000

_LORA_A = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?(\w+)\.lora_A(?:\.\w+)?\.weight$")
_GGUF_LORA = re.compile(r"^(?P<weight>.+)\.lora_(?P<part>[ab])$")


@dataclass(frozen=True)
class PeftWeight:
    """One adapted module of a PEFT adapter: its layer, its name (``q_proj``), and the
    shape of its ``lora_A`` matrix (``(r, in_features)``)."""

    layer: int
    module: str
    lora_a_shape: tuple[int, ...]


@dataclass(frozen=True)
class AdapterFacts:
    """What an adapter on disk says of itself.

    ``rank`` is the LoRA rank (``r``; for GGUF, the largest ``lora_a`` inner dimension);
    ``architecture`` is GGUF's ``general.architecture`` (``None`` for PEFT);
    ``trained_on`` is PEFT's ``base_model_name_or_path``; ``target_modules`` the adapted
    module names (PEFT: as configured; GGUF: the adapted weights' names).
    """

    format: AdapterFormat
    path: Path
    rank: int
    target_modules: tuple[str, ...]
    architecture: str | None = None
    trained_on: str | None = None
    peft_weights: tuple[PeftWeight, ...] = ()
    gguf_tensors: tuple[GgufTensor, ...] = ()


@dataclass(frozen=True)
class BaseFacts:
    """What a base model's files say, as far as the fit checks need: its format, its name
    on the hub when known (``config.json``'s ``_name_or_path``, or where it was pulled
    from), the HF ``config.json`` values, or the GGUF header."""

    format: Literal["hf", "gguf"]
    name_or_path: str | None = None
    model_type: str | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    attention_size: int | None = None
    num_layers: int | None = None
    gguf: GgufHeader | None = None


def adapter_format_of(path: Path) -> AdapterFormat:
    """The format a path names without reading it: ``gguf`` for a ``.gguf`` file, ``peft``
    otherwise (used for paths on another node's host, which the leader cannot read)."""
    return "gguf" if path.name.lower().endswith(".gguf") else "peft"


def inspect_adapter(path: Path) -> AdapterFacts:
    """Read the adapter at ``path`` (a PEFT folder or a GGUF LoRA file).

    Raises :class:`~berth.errors.NotFoundError` when it does not exist, and
    :class:`~berth.errors.ConfigError` saying why ``path`` is not an adapter: it cannot be
    read, is neither a regular file nor a folder (:func:`~berth.weights.model_files.
    checked_path`), a folder lacks ``adapter_config.json`` or weights, the config is not a
    LoRA one or has no positive rank, a file is not GGUF, or the GGUF is not a LoRA adapter.
    """
    _, status = checked_path(path, what="adapter")
    if stat.S_ISDIR(status.st_mode):
        return _inspect_peft(path)
    if not is_gguf(path):
        raise ConfigError(
            f"{path} is not an adapter: a LoRA adapter is a PEFT folder (with "
            f"{PEFT_CONFIG}) for vLLM and SGLang, or a GGUF LoRA file for llama.cpp"
        )
    return _inspect_gguf(path)


def _inspect_peft(path: Path) -> AdapterFacts:
    config_path = path / PEFT_CONFIG
    if not config_path.is_file():
        raise ConfigError(
            f"{path} is not an adapter: no {PEFT_CONFIG} in it (a PEFT LoRA folder has one)"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path} is not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise ConfigError(
            f"{path} is a {peft_type} adapter, not LoRA: engines load LoRA adapters only"
        )
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"{config_path} has no positive LoRA rank r (found {rank!r})")
    weights = next((path / name for name in PEFT_WEIGHTS if (path / name).is_file()), None)
    if weights is None:
        raise ConfigError(f"{path} has no adapter weights ({' or '.join(PEFT_WEIGHTS)})")
    modules = config.get("target_modules")
    if isinstance(modules, str):
        targets: tuple[str, ...] = (modules,)
    elif isinstance(modules, list) and all(isinstance(m, str) for m in modules) and modules:
        targets = tuple(sorted(modules))
    else:
        raise ConfigError(f"{config_path} names no target_modules")
    trained_on = config.get("base_model_name_or_path")
    peft_weights: tuple[PeftWeight, ...] = ()
    if weights.suffix == ".safetensors":
        peft_weights = _safetensors_lora_a(weights)
    return AdapterFacts(
        format="peft",
        path=path,
        rank=rank,
        target_modules=targets,
        trained_on=trained_on if isinstance(trained_on, str) and trained_on else None,
        peft_weights=peft_weights,
    )


def _safetensors_lora_a(path: Path) -> tuple[PeftWeight, ...]:
    """Each ``lora_A`` tensor of a safetensors file, from its header alone."""
    try:
        with path.open("rb") as file:
            size_bytes = file.read(8)
            if len(size_bytes) != 8:
                raise ConfigError(f"{path} is not a safetensors file")
            size = struct.unpack("<Q", size_bytes)[0]
            if size > MAX_SAFETENSORS_HEADER_BYTES:
                raise ConfigError(f"{path}: a safetensors header of {size} bytes")
            header = json.loads(file.read(size))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise ConfigError(f"{path} is not a safetensors file") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a safetensors file")
    found: list[PeftWeight] = []
    for name, info in header.items():
        match = _LORA_A.search(name)
        if match is None or not isinstance(info, dict):
            continue
        shape = info.get("shape")
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            found.append(PeftWeight(int(match.group(1)), match.group(2), tuple(shape)))
    return tuple(sorted(found, key=lambda w: (w.layer, w.module)))


def _inspect_gguf(path: Path) -> AdapterFacts:
    header = read_gguf_header(path)
    kind = header.text("general.type")
    if kind != "adapter":
        raise ConfigError(
            f"{path} is a GGUF {kind or 'model'}, not an adapter (a LoRA GGUF has "
            "general.type = adapter, as llama.cpp's convert_lora_to_gguf.py writes)"
        )
    adapter_type = header.text("adapter.type")
    if adapter_type != "lora":
        raise ConfigError(
            f"{path} is a {adapter_type or 'untyped'} adapter, not LoRA (adapter.type)"
        )
    pairs: dict[str, dict[str, GgufTensor]] = {}
    for tensor in header.tensors.values():
        match = _GGUF_LORA.match(tensor.name)
        if match is not None:
            pairs.setdefault(match["weight"], {})[match["part"]] = tensor
    if not pairs:
        raise ConfigError(f"{path} holds no LoRA tensors (*.lora_a, *.lora_b)")
    ranks = set()
    for weight, parts in sorted(pairs.items()):
        if set(parts) != {"a", "b"}:
            raise ConfigError(f"{path}: {weight} lacks its lora_a or lora_b tensor")
        a, b = parts["a"], parts["b"]
        if len(a.shape) < 2 or len(b.shape) < 2 or a.shape[1] != b.shape[0]:
            raise ConfigError(
                f"{path}: {weight}.lora_a {list(a.shape)} and .lora_b {list(b.shape)} "
                "do not share a rank"
            )
        ranks.add(a.shape[1])
    modules = sorted({_module_of(weight) for weight in pairs})
    tensors = tuple(t for parts in pairs.values() for t in parts.values())
    return AdapterFacts(
        format="gguf",
        path=path,
        rank=max(ranks),
        target_modules=tuple(modules),
        architecture=header.text("general.architecture"),
        gguf_tensors=tuple(sorted(tensors, key=lambda t: t.name)),
    )


def _module_of(weight: str) -> str:
    # "blk.3.attn_q.weight" -> "attn_q"
    parts = weight.split(".")
    if len(parts) >= 3 and parts[0] == "blk":
        return parts[2]
    return parts[0]


def inspect_base(model_path: Path, *, repo_id: str | None = None) -> BaseFacts | None:
    """What the fit checks need of the base model at ``model_path``: a GGUF header, or a
    folder's ``config.json`` (``repo_id``, where it was pulled from, names it when the
    config does not). ``None`` when the path holds neither (nothing to check against).

    Raises :class:`~berth.errors.ConfigError` for a GGUF or ``config.json`` that cannot
    be read.
    """
    if model_path.is_dir():
        config_path = model_path / "config.json"
        if config_path.is_file():
            return _hf_base(config_path, repo_id)
        ggufs = sorted(p for p in model_path.glob("*.gguf") if not p.name.startswith("mmproj"))
        if len(ggufs) != 1:
            return None
        model_path = ggufs[0]
    if model_path.is_file() and is_gguf(model_path):
        header = read_gguf_header(model_path)
        return BaseFacts(format="gguf", name_or_path=repo_id, gguf=header)
    return None


def _hf_base(config_path: Path, repo_id: str | None) -> BaseFacts:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path} is not a JSON object")

    def number(key: str) -> int | None:
        found = config.get(key)
        return found if isinstance(found, int) and not isinstance(found, bool) else None

    hidden = number("hidden_size")
    heads = number("num_attention_heads")
    head_dim = number("head_dim") or (hidden // heads if hidden and heads else None)
    named = config.get("_name_or_path")
    return BaseFacts(
        format="hf",
        name_or_path=repo_id or (named if isinstance(named, str) and named else None),
        model_type=config.get("model_type") if isinstance(config.get("model_type"), str) else None,
        hidden_size=hidden,
        intermediate_size=number("intermediate_size"),
        attention_size=heads * head_dim if heads and head_dim else None,
        num_layers=number("num_hidden_layers"),
    )


def check_fits(adapter: AdapterFacts, base: BaseFacts, *, base_name: str) -> list[str]:
    """Every reason ``adapter`` cannot be applied to ``base`` (named ``base_name`` in the
    reasons); empty when it fits as far as the files tell."""
    if adapter.format == "gguf":
        if base.format != "gguf" or base.gguf is None:
            return [
                f"a GGUF LoRA file is for llama.cpp, but model {base_name!r} is not a GGUF "
                "model; register a PEFT adapter folder for vLLM or SGLang instead"
            ]
        return _gguf_misfits(adapter, base.gguf, base_name)
    if base.format != "hf":
        return [
            f"a PEFT adapter folder is for vLLM and SGLang, but model {base_name!r} is a GGUF "
            "model (llama.cpp); convert the adapter with llama.cpp's convert_lora_to_gguf.py"
        ]
    return _peft_misfits(adapter, base, base_name)


def _gguf_misfits(adapter: AdapterFacts, base: GgufHeader, base_name: str) -> list[str]:
    reasons: list[str] = []
    base_arch = base.text("general.architecture")
    if adapter.architecture != base_arch:
        reasons.append(
            f"the adapter is for architecture {adapter.architecture!r}, model {base_name!r} "
            f"is {base_arch!r}"
        )
        return reasons
    for tensor in adapter.gguf_tensors:
        match = _GGUF_LORA.match(tensor.name)
        assert match is not None  # only LoRA tensors are kept
        target = base.tensors.get(match["weight"])
        if target is None:
            reasons.append(f"model {base_name!r} has no tensor {match['weight']}")
            continue
        # lora_a: ne = [W.ne[0], r]; lora_b: ne = [r, W.ne[1]]
        axis, expected = (0, target.shape[0]) if match["part"] == "a" else (1, target.shape[1])
        if tensor.shape[axis] != expected:
            reasons.append(
                f"{tensor.name} has shape {list(tensor.shape)}, which does not fit "
                f"{match['weight']} {list(target.shape)} of model {base_name!r}"
            )
    return reasons[:5]


def _peft_misfits(adapter: AdapterFacts, base: BaseFacts, base_name: str) -> list[str]:
    reasons: list[str] = []
    trained, named = adapter.trained_on, base.name_or_path
    if trained and named and _repo_name(trained) != _repo_name(named):
        reasons.append(f"the adapter was trained on {trained!r}, model {base_name!r} is {named!r}")
    inputs = {
        "q_proj": base.hidden_size,
        "k_proj": base.hidden_size,
        "v_proj": base.hidden_size,
        "gate_proj": base.hidden_size,
        "up_proj": base.hidden_size,
        "o_proj": base.attention_size,
        "down_proj": base.intermediate_size,
    }
    for weight in adapter.peft_weights:
        if base.num_layers is not None and weight.layer >= base.num_layers:
            reasons.append(
                f"the adapter changes layer {weight.layer}, model {base_name!r} has "
                f"{base.num_layers} layers"
            )
            break
        if weight.lora_a_shape and weight.lora_a_shape[0] != adapter.rank:
            reasons.append(
                f"layer {weight.layer} {weight.module} has rank {weight.lora_a_shape[0]}, "
                f"the config says r = {adapter.rank}"
            )
            break
        expected = inputs.get(weight.module)
        if expected is not None and weight.lora_a_shape[-1] != expected:
            reasons.append(
                f"layer {weight.layer} {weight.module} takes {weight.lora_a_shape[-1]} inputs, "
                f"model {base_name!r} has {expected}"
            )
            break
    return reasons


def _repo_name(name_or_path: str) -> str:
    """``org/Name`` or ``/models/org--Name`` -> ``name`` (compared case-blind)."""
    last = name_or_path.rstrip("/").rsplit("/", 1)[-1]
    return last.rsplit("--", 1)[-1].lower()
