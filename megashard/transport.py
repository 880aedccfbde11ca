"""The only module that talks to ``torch.distributed``.

Metadata travels as JSON inside uint8 tensors (never pickled, unlike torch's
``*_object`` collectives). Every phase of a save or load ends in :meth:`Comm.agree`,
which exchanges each rank's success or error message, so one failing rank makes
every rank raise the same :class:`DistributedError` instead of leaving peers
waiting in a later collective. Works without an initialised process group (a
single process is a world of one).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from .errors import MegashardError, distributed_error

log = logging.getLogger(__name__)
T = TypeVar("T")


def _dist():
    import torch.distributed as dist

    return dist


class Comm:
    """A process group plus the handful of operations checkpointing needs."""

    def __init__(self, group: Any = None) -> None:
        dist = _dist()
        self.group = group
        self.is_dist = dist.is_available() and dist.is_initialized()
        if self.is_dist:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group)).lower()
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"
        self.device = torch.device("cpu")
        if "nccl" in self.backend:
            self.device = torch.device("cuda", torch.cuda.current_device())

    # -- helpers -----------------------------------------------------------
    def global_rank(self, group_rank: int) -> int:
        if not self.is_dist or self.group is None:
            return group_rank
        return _dist().get_global_rank(self.group, group_rank)

    def _bytes_tensor(self, data: bytes, size: int) -> torch.Tensor:
        t = torch.zeros(size, dtype=torch.uint8)
        if data:
            t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return t.to(self.device)

    # -- collectives (JSON) --------------------------------------------------
    def all_gather_json(self, obj: Any) -> List[Any]:
        data = json.dumps(obj, separators=(",", ":")).encode()
        if not self.is_dist or self.world_size == 1:
            return [json.loads(data)]
        dist = _dist()
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self.group)
        lens = [int(s.item()) for s in sizes]
        m = max(lens)
        out = [torch.empty(m, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(out, self._bytes_tensor(data, m), group=self.group)
        return [json.loads(bytes(t[:k].cpu().numpy())) for t, k in zip(out, lens)]

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        if not self.is_dist or self.world_size == 1:
            return obj
        dist = _dist()
        data = json.dumps(obj, separators=(",", ":")).encode() if self.rank == src else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(n, src=self.global_rank(src), group=self.group)
        buf = self._bytes_tensor(data, int(n.item()))
        dist.broadcast(buf, src=self.global_rank(src), group=self.group)
        return json.loads(bytes(buf.cpu().numpy())) if self.rank != src else obj

    def gather_json(self, obj: Any, dst: int = 0) -> Optional[List[Any]]:
        """Gather to ``dst`` (other ranks get None). gloo and NCCL both support all_gather,
        which is used so that every backend works the same."""
        everything = self.all_gather_json(obj) if self.world_size > 1 else [obj]
        return everything if self.rank == dst else None

    def barrier(self) -> None:
        if self.is_dist and self.world_size > 1:
            _dist().barrier(group=self.group)

    # -- error aggregation ---------------------------------------------------
    def agree(self, error: Optional[str], what: str, payload: Any = None) -> List[Any]:
        """Exchange status (and an optional payload); raise on every rank if any failed.

        Returns every rank's payload when all succeeded.
        """
        everything = self.all_gather_json({"error": error, "payload": payload})
        failures = {r: e["error"] for r, e in enumerate(everything) if e["error"]}
        if failures:
            raise distributed_error(failures, what)
        return [e["payload"] for e in everything]

    def run(self, what: str, fn: Callable[[], T]) -> Tuple[Optional[T], Optional[str]]:
        """Run ``fn`` locally, capturing any exception as a message for :meth:`agree`."""
        try:
            return fn(), None
        except MegashardError as e:
            log.debug("rank %d: %s failed", self.rank, what, exc_info=True)
            return None, f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
            return None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"

    # -- point to point --------------------------------------------------------
    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send a contiguous tensor to group rank ``dst`` (staged through the device for NCCL)."""
        if self.device.type == "cuda" and t.device.type != "cuda":
            t = t.to(self.device, non_blocking=False)
        _dist().send(t, dst=self.global_rank(dst), group=self.group)

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Receive into a contiguous tensor from group rank ``src``."""
        if self.device.type == "cuda" and t.device.type != "cuda":
            tmp = torch.empty_like(t, device=self.device)
            _dist().recv(tmp, src=self.global_rank(src), group=self.group)
            t.copy_(tmp)
            return
        _dist().recv(t, src=self.global_rank(src), group=self.group)

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        """Start sending a contiguous tensor; returns a handle with ``wait()``.

        The tensor must stay untouched until the handle completes."""
        if self.device.type == "cuda" and t.device.type != "cuda":
            t = t.to(self.device, non_blocking=False)
        return _dist().isend(t, dst=self.global_rank(dst), group=self.group)

    def irecv(self, t: torch.Tensor, src: int) -> Any:
        """Start receiving into a contiguous tensor; returns a handle with ``wait()``."""
        if self.device.type == "cuda" and t.device.type != "cuda":
            tmp = torch.empty_like(t, device=self.device)
            work = _dist().irecv(tmp, src=self.global_rank(src), group=self.group)
            return _StagedRecv(work, tmp, t)
        return _dist().irecv(t, src=self.global_rank(src), group=self.group)

    # -- topology --------------------------------------------------------------
    def node_ids(self) -> List[str]:
        """Node identity of every rank: ``MEGASHARD_NODE_ID``, else torchrun's GROUP_RANK
        (node rank), else the host name. Collective."""
        me = os.environ.get("MEGASHARD_NODE_ID") or os.environ.get("GROUP_RANK")
        if me is None:
            me = socket.gethostname()
        return [str(x) for x in self.all_gather_json(str(me))]


class _StagedRecv:
    """An irecv into device memory that copies to the host destination on wait()."""

    def __init__(self, work: Any, tmp: torch.Tensor, dest: torch.Tensor) -> None:
        self.work, self.tmp, self.dest = work, tmp, dest

    def wait(self) -> None:
        self.work.wait()
        self.dest.copy_(self.tmp)


def node_readers(node_ids: Sequence[str]) -> Dict[int, int]:
    """Map each rank to its node's reader: the lowest rank on the same node."""
    first: Dict[str, int] = {}
    for r, n in enumerate(node_ids):
        first.setdefault(n, r)
    return {r: first[n] for r, n in enumerate(node_ids)}
