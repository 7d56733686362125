"""SGLang's distributed weight update over a rollout server: ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/destroy_weights_update_group``, in SGLang's request shapes.

The server joins the push's group as SGLang does (the store at ``master_address:master_port``, its keys laid out as
``agentloop.server.collective.group_store`` says) and receives each named tensor in its own broadcast from member 0;
so SGLang's clients, our ``sglang`` backend among them, push weights to it as to SGLang. Waits are bounded by the
server's ``weight_sync_timeout_s``.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import torch
import torch.distributed as dist
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from agentloop.server.collective import form_group, receive_tensors

SGLANG_GROUP = "weight_update_group"  # SGLang's default group_name


class InitGroupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = SGLANG_GROUP
    backend: str = "nccl"


class FromDistributedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = SGLANG_GROUP
    flush_cache: bool = True  # the engine flushes its cache on every update anyway
    abort_all_requests: bool = False  # requests in flight end interrupted on every update here
    weight_version: str | None = None  # a number: the policy version the server reports
    load_format: str | None = None


class GroupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = SGLANG_GROUP


def add_distributed_weight_routes(router: APIRouter, server: Any) -> None:
    """The three routes over ``server`` (a ``RolloutServer``: its ``settings`` bound the waits); the groups it has
    joined are kept by name until destroyed."""
    groups: dict[str, dist.ProcessGroup] = {}

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroupBody) -> dict[str, Any]:
        if body.group_name in groups:
            raise ValueError(f"the weight group {body.group_name!r} exists: destroy it first")
        if body.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend nccl needs a GPU; this server has none: send backend gloo")

        def join() -> dist.ProcessGroup:
            timeout_s = server.settings.weight_sync.timeout_s
            timeout = datetime.timedelta(seconds=timeout_s)
            store = dist.TCPStore(body.master_address, body.master_port, body.world_size, False, timeout)
            return form_group(store, body.group_name, body.backend, body.rank_offset, body.world_size, timeout_s)

        try:
            groups[body.group_name] = await asyncio.to_thread(join)
        except RuntimeError as error:  # torch's DistError: unreachable store, or members missing past the timeout
            raise ValueError(f"joining the weight group {body.group_name!r} failed: {error}") from error
        return {"success": True, "message": f"joined {body.group_name} as member {body.rank_offset}"}

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: FromDistributedBody) -> dict[str, Any]:
        if body.group_name not in groups:
            raise ValueError(f"no weight group {body.group_name!r}: call /init_weights_update_group first")
        if body.load_format is not None:
            raise ValueError(f"load_format {body.load_format!r} is not served here: send null (one tensor each)")
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            raise ValueError("names, dtypes and shapes must have one entry per tensor")
        slots = list(zip(body.names, body.dtypes, [tuple(shape) for shape in body.shapes]))
        try:
            received = await asyncio.to_thread(receive_tensors, groups[body.group_name], slots, "cpu")
        except RuntimeError as error:  # a member lost, or the source silent past the timeout
            raise ValueError(f"receiving {len(slots)} tensors over {body.group_name!r} failed: {error}") from error
        version = int(body.weight_version) if body.weight_version and body.weight_version.isdigit() else None
        await server.update_weights(received, version)
        return {"success": True, "message": f"loaded {len(received)} tensors"}

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: GroupBody) -> dict[str, Any]:
        if groups.pop(body.group_name, None) is None:
            raise ValueError(f"no weight group {body.group_name!r} (SGLang answers so too)")
        return {"success": True, "message": f"left {body.group_name}"}
