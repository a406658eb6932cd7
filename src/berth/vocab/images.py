"""The container images berth runs engines from: each engine's published image, the one
used instead when a deployment gets GPUs, and the check that a name is an image reference.

Used by the settings (the ``*_image`` defaults), placement (which image a deployment gets)
and the docker runtime.
"""

from __future__ import annotations

import re

from berth.errors import ConfigError
from berth.vocab.engines import EngineName

#: Each engine's published image, used by the docker runtime unless a setting or ``--image``
#: names another.  llama.cpp's ``server`` image runs ``llama-server`` as its entrypoint;
#: vLLM's ``vllm-openai`` runs its OpenAI server as its entrypoint; SGLang's image has no
#: server entrypoint, so berth gives it the whole command line.
DEFAULT_IMAGES: dict[EngineName, str] = {
    "llamacpp": "ghcr.io/ggml-org/llama.cpp:server",
    "vllm": "vllm/vllm-openai:latest",
    "sglang": "lmsysorg/sglang:latest",
}

#: The image used instead of :data:`DEFAULT_IMAGES` when a deployment gets GPUs: llama.cpp
#: publishes its CUDA build as a separate tag.
DEFAULT_GPU_IMAGES: dict[EngineName, str] = {"llamacpp": "ghcr.io/ggml-org/llama.cpp:server-cuda"}


#: Docker's image reference grammar (distribution/reference), simplified: an optional
#: registry host (with a dot or a port, or "localhost"), lower-case path components, an
#: optional tag (ASCII word characters, as Go's ``\w``), an optional digest. Also the
#: admin API schema's pattern for an image (anchored there).
IMAGE_REFERENCE_PATTERN = (
    r"(?:(?:[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)+(?::[0-9]+)?|localhost(?::[0-9]+)?"
    r"|[a-zA-Z0-9-]+:[0-9]+)/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?"
)
_IMAGE_REFERENCE = re.compile(IMAGE_REFERENCE_PATTERN)


def check_image_reference(image: str) -> str:
    """``image`` stripped, when it is a valid image reference (``repository[:tag][@digest]``,
    optionally behind a registry host); else ``ConfigError`` saying so."""
    text = image.strip()
    if not text:
        raise ConfigError("the docker image name is empty")
    if not _IMAGE_REFERENCE.fullmatch(text):
        raise ConfigError(
            f"{text!r} is not a docker image reference (repository[:tag], e.g. "
            "vllm/vllm-openai:latest)"
        )
    return text
