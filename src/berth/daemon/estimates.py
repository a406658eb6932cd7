"""VRAM estimates for the leader: model shapes read from files (cached), estimates per
deployment (remembered).

:func:`berth.placement.estimate_vram` is pure; this is the I/O beside it.  A model's shape is
read from its registered path on the leader's host (a GGUF header or an HF ``config.json``)
off the event loop, and kept while the file's size and modification time stay the same.  A
model registered only with paths on agents (``source == "remote"``) has no estimate: its
files are not on this host.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from berth.errors import ConfigError
from berth.placement import EstimateRequest, ModelShape, VramEstimate, estimate_vram
from berth.placement.errors import ModelFileError
from berth.placement.model_files import read_model_shape
from berth.runtime.engines import EngineName
from berth.store import DeploymentRecord, ModelRecord

#: Shapes kept (one per model file) and deployment estimates remembered.
MAX_SHAPES = 256
MAX_DEPLOYMENTS = 4096

_FileKey = tuple[str, int, int]


@dataclass(frozen=True)
class EstimateResult:
    """An estimate, or why there is none (``problem``)."""

    estimate: VramEstimate | None
    problem: str | None = None


class VramEstimator:
    """Estimates from model files, for placement and for the deployments already placed."""

    def __init__(self) -> None:
        self._shapes: OrderedDict[_FileKey, ModelShape] = OrderedDict()
        self._deployments: OrderedDict[str, EstimateResult] = OrderedDict()

    async def shape(self, model: ModelRecord) -> ModelShape:
        """The shape of ``model`` from its files on the leader's host.

        Raises :class:`~berth.placement.errors.ModelFileError` when they cannot be read (or
        are on other hosts only).
        """
        path = Path(model.path)
        if model.source == "remote":
            raise ModelFileError(
                f"model {model.name} has paths only on other nodes, so the leader cannot read "
                "its header",
                path=path,
            )
        key = await asyncio.to_thread(_file_key, path)
        found = self._shapes.get(key)
        if found is None:
            found = await asyncio.to_thread(read_model_shape, path)
            self._shapes[key] = found
            while len(self._shapes) > MAX_SHAPES:
                self._shapes.popitem(last=False)
        else:
            self._shapes.move_to_end(key)
        return found

    async def estimate(
        self,
        model: ModelRecord,
        engine: EngineName,
        *,
        ctx: int | None,
        extra_args: tuple[str, ...],
        gpu_count: int,
    ) -> EstimateResult:
        """The estimate of a deployment of ``model``, or why there is none (its files cannot
        be read).

        Raises :class:`~berth.errors.ConfigError` for a request the estimate refuses (a
        context that is not positive, an unknown cache type, a malformed memory flag).
        """
        try:
            shape = await self.shape(model)
        except ModelFileError as exc:
            return EstimateResult(None, str(exc))
        request = EstimateRequest(engine, ctx, extra_args, gpu_count)
        return EstimateResult(estimate_vram(shape, request))

    def remember(self, deployment_id: str, result: EstimateResult) -> None:
        """Keep the estimate a deployment was placed with."""
        self._deployments[deployment_id] = result
        while len(self._deployments) > MAX_DEPLOYMENTS:
            self._deployments.popitem(last=False)

    async def of_deployment(
        self, record: DeploymentRecord, model: ModelRecord | None, engine: EngineName
    ) -> EstimateResult:
        """The estimate ``record`` was placed with, else one made now from its model (a
        deployment from before this leader started); ``model`` ``None``: unknown model."""
        found = self._deployments.get(record.id)
        if found is not None:
            return found
        if model is None:
            result = EstimateResult(None, f"model {record.model_name} is not registered")
        else:
            try:
                result = await self.estimate(
                    model,
                    engine,
                    ctx=record.ctx,
                    extra_args=record.extra_args,
                    gpu_count=max(1, len(record.gpus)),
                )
            except ConfigError as exc:
                result = EstimateResult(None, str(exc))
        self.remember(record.id, result)
        return result


def _file_key(path: Path) -> _FileKey:
    """The path, size and modification time of ``path`` (a directory: its config.json)."""
    target = path / "config.json" if path.is_dir() else path
    try:
        stat = os.stat(target)
    except OSError:
        return (str(path), -1, -1)
    return (str(path), stat.st_size, stat.st_mtime_ns)
