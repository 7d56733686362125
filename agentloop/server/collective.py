"""Weights over collectives (``rollout.weight_sync=collective``): trainer rank 0 (the source) and the rollout servers
join one ``torch.distributed`` group made for a push, and the source broadcasts the weights in buckets, which each
server loads as they arrive.

The group is apart from the trainer's own: the source hosts a TCP store for it (``WeightSource.open_weight_group``)
and every member builds a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPUs) on that store directly, so the
servers never touch the trainer's default group. Its keys lie in the store as those of a group that SGLang's
``/init_weights_update_group`` forms (``group_store``), so an SGLang server joins it itself. It is made per push over
the servers alive then, so a server that supervision replaced is in the next one. A bucket travels as raw bytes:
tensors of any dtype share one, and each arrives in the dtype it left in; to SGLang, which receives tensor by tensor
(``/update_weights_from_distributed``), each tensor of a bucket travels in a broadcast of its own
(``WeightGroup.wire``). Every wait is bounded by ``weight_sync_timeout_s``; its error names the member and the setting.
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, TypeVar

import ray
import torch
import torch.distributed as dist

T = TypeVar("T")
Manifest = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, shape) per tensor, in broadcast order
ALIGN = 16  # every tensor starts at a multiple of this many bytes in its bucket, so a view of any dtype is aligned
SOURCE = "trainer rank 0"
GO, CALLED_OFF = "go", "called_off"  # store keys: the source saw every server join; the pool gave the push up


@dataclass(frozen=True)
class WeightGroup:
    """One push's group: the source's store at ``address:port``, the servers' ranks in group order (the source is
    member 0, ``ranks[i]`` member i + 1), the bucket size and the bound on every wait. ``section`` and ``role``
    name the settings and the servers in messages."""

    address: str
    port: int
    ranks: tuple[int, ...]
    bucket_bytes: int
    timeout_s: float
    backend: str = "gloo"
    section: str = "actor_rollout_ref.rollout"
    role: str = "rollout server"
    name: str = "agentloop-weights"  # the group's name (SGLang's group_name): its keys' prefix in the store
    wire: str = "buckets"  # "buckets": one broadcast of raw bytes per bucket; "tensors": one per tensor (SGLang)
    members_per_server: int = 1  # an SGLang server's tensor-parallel ranks each join

    @property
    def world_size(self) -> int:
        return len(self.ranks) * self.members_per_server + 1

    def member(self, rank: int) -> int:
        """Server ``rank``'s (first) place in the group."""
        return self.ranks.index(rank) * self.members_per_server + 1

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def bounded(self, who: str, what: str, call: Callable[[], T]) -> T:
        """``call()``, its error (a timeout, a lost peer) re-raised naming ``who``, ``what`` and the settings."""
        try:
            return call()
        except Exception as error:  # torch's DistError and its kin; nothing else is raised in these calls
            raise RuntimeError(
                f"{who}: {what} failed (every wait is bounded by {self.section}.weight_sync_timeout_s="
                f"{self.timeout_s:g}; the group's store is at {self.address}:{self.port}, "
                f"{self.section}.weight_sync_master_addr / weight_sync_master_port): {type(error).__name__}: {error}"
            ) from error

    def process_group(self, store: dist.Store, member: int, who: str) -> dist.ProcessGroup:
        """This member's handle on the group (every member must call it; bounded by the timeout)."""
        return self.bounded(
            who,
            "joining the weight group",
            lambda: form_group(store, self.name, self.backend, member, self.world_size, self.timeout_s),
        )


def group_store(store: dist.Store, name: str, device: str) -> dist.Store:
    """Where the group ``name`` keeps its keys in ``store``: as torch's ``_new_process_group_helper`` lays out a
    group formed from a ``tcp://`` rendezvous and given a name, which is what SGLang's ``init_custom_process_group``
    (behind ``/init_weights_update_group``) does: the name as the rendezvous's prefix, again as the group's, then the
    device of the group's one backend (``cpu`` for gloo, ``cuda`` for NCCL). Members whose keys differ never meet."""
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))


def form_group(
    store: dist.Store, name: str, backend: str, member: int, world_size: int, timeout_s: float
) -> dist.ProcessGroup:
    """Member ``member``'s handle on the group ``name`` of ``world_size`` (blocks until all have come)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(group_store(store, name, "cuda"), member, world_size, options)
    if backend != "gloo":
        raise ValueError(f"weight group backend {backend!r}: use gloo (CPU) or nccl (GPUs)")
    return dist.ProcessGroupGloo(group_store(store, name, "cpu"), member, world_size, timeout)


def receive_tensors(
    process_group: dist.ProcessGroup, slots: list[tuple[str, str, tuple[int, ...]]], device: str
) -> dict[str, torch.Tensor]:
    """A member's receipt of one broadcast per ``(name, dtype, shape)`` in order, from member 0 (SGLang's
    ``/update_weights_from_distributed``: the source's ``wire="tensors"``); bounded by the group's timeout."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    received = {}
    for name, dtype, shape in slots:
        received[name] = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
        process_group.broadcast([received[name]], options).wait()
    return received


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def bucket_plan(manifest: Manifest, bucket_bytes: int) -> list[tuple[int, list[Slot]]]:
    """The buckets, in order, as ``(size in bytes, slots)``: tensors in manifest order, a new bucket whenever the next
    would overflow ``bucket_bytes`` (a tensor larger than that travels alone). Source and servers compute the same."""
    buckets: list[tuple[int, list[Slot]]] = []
    size, slots = 0, []
    for name, dtype, shape in manifest:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        if slots and size + nbytes > bucket_bytes:
            buckets.append((size, slots))
            size, slots = 0, []
        slots.append(Slot(name, dtype, tuple(shape), size, nbytes))
        size += -(-nbytes // ALIGN) * ALIGN
    if slots:
        buckets.append((size, slots))
    return buckets


class WeightSource:
    """Mixed into the trainer's rank actor: rank 0 keeps the weights of the latest push (``keep_weights``) and sends
    them to a group's servers, for a push or for a replacement server that needs the latest ones."""

    _kept_weights: Mapping[str, torch.Tensor] | None = None
    _weight_store: dist.TCPStore | None = None

    def keep_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Keep ``state`` (rank 0's gathered policy; empty on the other ranks) as what the next broadcasts send."""
        self._kept_weights = state or None

    def open_weight_group(self, port: int, timeout_s: float) -> tuple[str, int]:
        """Start a push's TCP store on this node (``port``; 0: a free one); returns this node's address and the
        store's port. The previous push's store is closed first."""
        self._weight_store = None
        store = dist.TCPStore(
            "0.0.0.0", port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self._weight_store = store
        return ray.util.get_node_ip_address(), store.port

    def broadcast_weights(self, group: WeightGroup) -> int:
        """Send the kept weights to ``group``'s servers, bucket by bucket; returns the bytes sent."""
        state, store = self._kept_weights, self._weight_store
        if state is None or store is None:
            raise RuntimeError("broadcast_weights: call keep_weights (on rank 0) and open_weight_group first")
        manifest = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]
        store.set("manifest", pickle.dumps(manifest))
        _wait_for_servers(store, group)
        process_group, sent = group.process_group(store, 0, SOURCE), 0
        for index, (size, slots) in enumerate(plan := bucket_plan(manifest, group.bucket_bytes)):
            what = f"sending bucket {index + 1}/{len(plan)}"
            if group.wire == "tensors":
                for slot in slots:
                    tensor = state[slot.name].detach().contiguous().to(group.device)
                    _broadcast(process_group, tensor, group, SOURCE, f"{what} ({slot.name})")
                    sent += slot.nbytes
                continue
            flat = torch.zeros(size, dtype=torch.uint8)
            for slot in slots:
                flat[slot.offset : slot.offset + slot.nbytes] = state[slot.name].detach().reshape(-1).view(torch.uint8)
            _broadcast(process_group, flat.to(group.device), group, SOURCE, what)
            sent += size
        return sent


def _wait_for_servers(store: dist.TCPStore, group: WeightGroup) -> None:
    """Until every server has reached the store (then tell them to go on); past the timeout, an error naming those
    that have not."""
    keys = [f"joined/{rank}" for rank in group.ranks]
    if not _until(store, keys, group, SOURCE):
        missing = [rank for rank, key in zip(group.ranks, keys) if not store.check([key])]
        names = ", ".join(f"{group.role} {rank}" for rank in missing)
        raise RuntimeError(
            f"{names} did not join the weight group at {group.address}:{group.port} within "
            f"{group.section}.weight_sync_timeout_s={group.timeout_s:g}s (check that the servers reach "
            f"{group.section}.weight_sync_master_addr / weight_sync_master_port, and that they are alive)"
        )
    store.set(GO, b"1")


def _until(store: dist.Store, keys: list[str], group: WeightGroup, who: str) -> bool:
    """Whether ``keys`` all appear in the store within the timeout; raises as soon as the push is called off (the
    pool found a member dead or hung: waiting for it would cost the whole timeout)."""
    deadline = time.monotonic() + group.timeout_s
    while not store.check(keys):
        if store.check([CALLED_OFF]):
            raise RuntimeError(f"{who}: the weight push was called off: {store.get(CALLED_OFF).decode()}")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def call_off(group: WeightGroup, reason: str) -> None:
    """Tell every member of ``group`` still gathering that the push is given up (a member was lost), so that none
    waits out its timeout for it. Best effort: a store that cannot be reached leaves the members to their timeout."""
    try:
        store = dist.TCPStore(group.address, group.port, None, False, datetime.timedelta(seconds=5))
        store.set(CALLED_OFF, reason.encode())
    except Exception:  # torch's DistError: the store is gone or unreachable
        pass


def _broadcast(process_group: dist.ProcessGroup, flat: torch.Tensor, group: WeightGroup, who: str, what: str) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.bounded(who, what, lambda: process_group.broadcast([flat], options).wait())


class WeightReceiver:
    """A server's end of one push: ``join`` (the store, the manifest, the group), then ``buckets``. Blocking calls:
    the server runs them off its event loop."""

    def __init__(self, group: WeightGroup, rank: int) -> None:
        self.group, self.rank, self.who = group, rank, f"{group.role} {rank}"
        self.process_group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        self.manifest: Manifest = []

    def join(self) -> Manifest:
        """Reach the source's store, read what this push sends, and join the group."""
        manifest = self.gather()
        self.process_group = self.group.process_group(self.store, self.group.member(self.rank), self.who)
        return manifest

    def gather(self) -> Manifest:
        """Reach the source's store and read what this push sends; the group is formed next, by ``join`` or by a
        server that joins it itself (SGLang's ``/init_weights_update_group``)."""
        group, timeout = self.group, datetime.timedelta(seconds=self.group.timeout_s)
        store = group.bounded(
            self.who,
            f"reaching the weight group's store at {group.address}:{group.port}",
            lambda: dist.TCPStore(group.address, group.port, None, False, timeout),
        )
        store.set(f"joined/{self.rank}", b"1")
        if not _until(store, [GO], group, self.who):
            raise RuntimeError(
                f"{self.who}: {SOURCE} did not start the push within {group.section}.weight_sync_timeout_s="
                f"{group.timeout_s:g}s (another server may not have joined)"
            )
        self.manifest = pickle.loads(
            group.bounded(self.who, "reading the push's manifest", lambda: store.get("manifest"))
        )
        self.store = store
        return self.manifest

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each bucket as it arrives: its tensors, viewing the received bytes in their own dtypes and shapes."""
        assert self.process_group is not None, "join() first"
        plan = bucket_plan(self.manifest, self.group.bucket_bytes)
        for index, (size, slots) in enumerate(plan):
            flat = torch.empty(size, dtype=torch.uint8, device=self.group.device)
            _broadcast(self.process_group, flat, self.group, self.who, f"receiving bucket {index + 1}/{len(plan)}")
            yield {
                slot.name: flat[slot.offset : slot.offset + slot.nbytes]
                .view(getattr(torch, slot.dtype))
                .view(slot.shape)
                for slot in slots
            }
