"""A Hugging Face model directory's shape: ``config.json`` and the weight files' sizes.

The keys are those of ``transformers``' ``PretrainedConfig`` for decoder models (the
"Configuration" page of the transformers documentation; e.g. ``LlamaConfig``,
``Qwen2Config``): ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads`` (default: ``num_attention_heads``, as ``LlamaConfig`` documents),
``head_dim`` (default: ``hidden_size // num_attention_heads``), ``max_position_embeddings``,
``vocab_size`` and ``torch_dtype`` (written as ``dtype`` by recent transformers releases).
A multimodal model's language part is read from its ``text_config`` when the top level has
no layer count (Llava, Gemma 3, Mistral 3).

The weights are the ``*.safetensors`` files (the format vLLM and SGLang load first), else the
``*.bin`` PyTorch files; their sizes on disk are what the engine copies to the GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from berth.placement.errors import ModelFileError
from berth.placement.shape import ModelShape

#: config.json larger than this is not a config (it would be read whole).
MAX_CONFIG_BYTES = 4 << 20


def read_hf_shape(directory: Path) -> ModelShape:
    """The :class:`ModelShape` of the HF model in ``directory``.

    Raises :class:`ModelFileError` when ``config.json`` is missing, unreadable, not a JSON
    object or lacks a value the estimate needs, and when there are no weight files.
    """
    config_path = directory / "config.json"
    try:
        if config_path.stat().st_size > MAX_CONFIG_BYTES:
            raise ModelFileError("config.json is too large to be a model config", path=config_path)
        loaded: object = json.loads(config_path.read_bytes())
    except OSError as exc:
        raise ModelFileError(f"cannot read it: {exc.strerror}", path=config_path) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"not valid JSON: {exc}", path=config_path) from None
    if not isinstance(loaded, dict):
        raise ModelFileError("not a JSON object", path=config_path)
    return shape_from_config(loaded, config_path, weights_bytes=weights_bytes(directory))


def weights_bytes(directory: Path) -> int:
    """The size of the model's weight files: ``*.safetensors``, else ``*.bin``.

    Raises :class:`ModelFileError` when there are neither.
    """
    for pattern in ("*.safetensors", "*.bin"):
        files = [p for p in directory.glob(pattern) if p.is_file()]
        if files:
            return sum(p.stat().st_size for p in files)
    raise ModelFileError("no *.safetensors or *.bin weight files", path=directory)


def shape_from_config(config: dict[str, object], path: Path, *, weights_bytes: int) -> ModelShape:
    """The estimate's inputs from a parsed ``config.json`` (``path`` names it in errors)."""
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        config = {**text, **config}  # the language part's shape, the model's own name

    def number(key: str, default: int | None = None) -> int:
        found = config.get(key, default)
        if isinstance(found, bool) or not isinstance(found, int) or found <= 0:
            raise ModelFileError(f"no usable {key} (found {found!r})", path=path)
        return found

    layers = number("num_hidden_layers")
    hidden = number("hidden_size")
    heads = number("num_attention_heads")
    kv_heads = number("num_key_value_heads", heads)
    # Some configs write "head_dim": null, meaning the default.
    head_dim = number("head_dim") if config.get("head_dim") is not None else hidden // heads
    context = config.get("max_position_embeddings")
    vocab = config.get("vocab_size")
    dtype = config.get("torch_dtype", config.get("dtype"))
    architectures = config.get("architectures")
    model_type = config.get("model_type")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        architecture = architectures[0]
    else:
        architecture = model_type if isinstance(model_type, str) else "unknown"
    return ModelShape(
        format="hf",
        architecture=architecture,
        weights_bytes=weights_bytes,
        block_count=layers,
        embedding_length=hidden,
        head_count=heads,
        layer_kv_heads=(kv_heads,) * layers,
        key_length=head_dim,
        value_length=head_dim,
        context_length=context if isinstance(context, int) and context > 0 else None,
        vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
        dtype=dtype if isinstance(dtype, str) else None,
        source=path,
    )
