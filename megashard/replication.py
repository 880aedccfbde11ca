"""Peer replication of the local checkpoint tier, and the restart that takes a rank's bytes from a peer.

A local version (:mod:`megashard.localtier`) survives the worker processes, not the node. With
replication, after every local save commits, each rank's new version is sent in the background to
the other ranks of its *replica group*, which are on other nodes; each keeps it as an ordinary
committed megashard checkpoint under ``DIR/megashard-<layout>/replicas/rankNNNNN/iter_N`` (temp
directory, byte count and CRC32 of every file checked, then one rename: a replication killed
mid-way leaves only a temporary, the previous replica stays usable), at most
:data:`~megashard.localtier.KEEP` versions per source rank, files ``0600``.

Replica groups are Megatron's (nvidia-resiliency-ext's ``CliqueReplicationStrategy``):
``--replication-jump J --replication-factor F`` split the ranks into blocks of ``J*F``; inside a
block, rank ``r``'s group is ``r, r+J, ..., r+(F-1)J`` (modulo the block). J is normally the
number of ranks per node, so the members are on F different nodes; a J that puts two members on
one node is refused (:func:`check_peers`).

The transfers run over a gloo process group of their own (:func:`megashard.transport.side_group`),
so the background thread never interleaves with the job's collectives.

On restart (:func:`resolve`), each rank reports its own complete iterations and those of the
replicas it holds; rank 0 picks the newest iteration complete for every rank (own or replica),
and each rank whose own copy is missing receives it from a rank holding the replica, into its own
directory, before the job loads its own versions as usual. Nothing here pickles; names received
from peers are checked like a manifest's.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from isal import isal_zlib

from . import localtier, storage
from .errors import CheckpointError, DistributedError
from .transport import Comm, node_id, side_group

logger = logging.getLogger(__name__)

#: bytes per message of a transfer (memory per transfer in flight: one chunk per peer)
CHUNK = 64 << 20
_NODE_BYTES = 256


def replica_group(rank: int, world: int, jump: int, factor: int) -> List[int]:
    """The ranks holding copies of rank ``rank``'s versions, itself included, ascending: Megatron's
    ``--replication-jump``/``--replication-factor`` groups (``r, r+J, ...`` within blocks of J*F ranks)."""
    if jump < 1 or factor < 1:
        raise CheckpointError(f"--replication-jump {jump} and --replication-factor {factor} must both be >= 1")
    block = jump * factor
    if world % block:
        raise CheckpointError(f"--replication-jump {jump} x --replication-factor {factor} = {block} ranks per "
                              f"replica block must divide the world size {world}; set --replication-jump to the "
                              f"number of ranks per node and a factor that divides the number of nodes")
    base = rank - rank % block + rank % jump
    return [base + i * jump for i in range(factor)]


def resolve_jump(jump: Optional[int]) -> int:
    """``--replication-jump``: required, as Megatron requires it."""
    if jump:
        return int(jump)
    raise CheckpointError("--replication requires --replication-jump J (the spacing of a rank's replicas: "
                          "the number of ranks per node puts them on other nodes)")


def check_peers(comm: Comm, side: Comm, group: Sequence[int], jump: int) -> None:
    """Collective: every rank learns its group members' nodes (one small exchange with them only)
    and the job fails on every rank, naming the ranks and the node, when two share a node."""
    me = node_id().encode()[:_NODE_BYTES]
    peers = [p for p in group if p != comm.rank]

    def check() -> None:
        mine = torch.zeros(_NODE_BYTES, dtype=torch.uint8)
        mine[: len(me)] = torch.frombuffer(bytearray(me), dtype=torch.uint8)
        theirs = {p: torch.zeros(_NODE_BYTES, dtype=torch.uint8) for p in peers}
        side.exchange([(mine, p) for p in peers], [(theirs[p], p) for p in peers], "replica group nodes").wait()
        same = [p for p in peers if bytes(theirs[p].numpy()).rstrip(b"\0") == me]
        if same:
            raise CheckpointError(
                f"--replication-jump {jump}: rank {comm.rank} and its replica rank{'s' if len(same) > 1 else ''} "
                f"{', '.join(map(str, same))} are on the same node {me.decode(errors='replace')!r}: a replica "
                f"there is lost with the node; set --replication-jump to the number of ranks per node")

    _, err = comm.run("replication/check", check)
    comm.agree(err, "replication (replica group check)")


# --------------------------------------------------------------------------------------
# moving committed versions between ranks
# --------------------------------------------------------------------------------------
def _files(d: str) -> List[Tuple[str, int]]:
    """The regular files of a committed version, sorted, with their sizes."""
    out = []
    for name in sorted(os.listdir(d)):
        st = os.lstat(os.path.join(d, name))
        if stat.S_ISREG(st.st_mode):
            out.append((name, st.st_size))
    if not any(n == storage.MANIFEST_NAME for n, _ in out):
        raise CheckpointError(f"{d} has no {storage.MANIFEST_NAME}: not a committed version")
    return out


def _chunks(files: Sequence[Tuple[str, int]]) -> List[Tuple[int, int, int]]:
    """(file index, offset, length) of every message, in order."""
    return [(i, off, min(CHUNK, size - off)) for i, (_, size) in enumerate(files) for off in range(0, size, CHUNK)]


class _Incoming:
    """One version being received into a temporary directory beside ``final``."""

    def __init__(self, final: str, src: int, header: Dict[str, Any]) -> None:
        self.final, self.src, self.tmp, self.error = final, src, None, header.get("error")
        #: the sender's file list (structure checked by _exchange_headers): it fixes the stream's
        #: messages, so it is kept even when a name is refused (the bytes are then only consumed)
        self.files: List[Tuple[str, int]] = [(n, s) for n, s in header.get("files") or []]
        self.crcs = [0] * len(self.files)
        self.handles: List[Any] = []
        if self.error:
            return
        try:
            for name, _ in self.files:
                storage.check_member_name(name, f"replica of rank {src} for {final}")
            if os.path.isdir(os.path.dirname(final)):  # what a killed transfer left (its owner is gone)
                storage.cleanup_stale_temps(os.path.dirname(final))
            os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
            self.tmp = storage.make_temp_dir(final, uuid.uuid4().hex)
            for name, _ in self.files:
                fd = os.open(os.path.join(self.tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                self.handles.append(os.fdopen(fd, "wb"))
        except (OSError, CheckpointError) as e:
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, why: str) -> None:
        self.error = self.error or why

    def write(self, i: int, off: int, buf: torch.Tensor) -> None:
        if self.error:
            return  # keep consuming the stream, so the peer's transfer completes
        try:
            view = buf.numpy()
            self.crcs[i] = isal_zlib.crc32(view, self.crcs[i])
            self.handles[i].write(view)
        except OSError as e:
            self._fail(f"writing {self.files[i][0]}: {e}")

    def finish(self, sent_crcs: List[int]) -> Optional[str]:
        for h in self.handles:
            try:
                h.close()
            except OSError as e:
                self._fail(f"closing: {e}")
        if not self.error and sent_crcs != self.crcs:
            bad = [self.files[i][0] for i, (a, b) in enumerate(zip(sent_crcs, self.crcs)) if a != b]
            self._fail(f"CRC32 of {', '.join(bad[:4]) or 'the file list'} differs from the sender's")
        if not self.error:
            try:
                storage.commit_dir(self.tmp, self.final)
                os.chmod(self.final, 0o700)
                storage.apply_retention(os.path.dirname(self.final), localtier.KEEP)
                return None
            except (OSError, CheckpointError) as e:
                self._fail(f"committing: {e}")
        if self.tmp and os.path.isdir(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)  # our own temporary: never a version
        return f"receiving {self.final} from rank {self.src}: {self.error}"


def transfer(side: Comm, sends: Sequence[Tuple[str, Sequence[int]]], recvs: Sequence[Tuple[str, int]],
             what: str = "replication") -> List[Optional[str]]:
    """Copy committed versions between ranks of ``side`` (every rank calls it with its own lists, which
    must match its peers': a send to ``d`` here, a receive from this rank there).

    ``sends``: (committed version directory, destination ranks); ``recvs``: (final directory, source
    rank), at most one per source. Each received version lands in a temporary directory and is
    committed by rename only when every byte arrived and every file's CRC32 matches the sender's.
    Returns one error message (or None) per receive; a local failure (a missing source, a full disk)
    never stops the stream, so peers finish too. A dead peer raises DistributedError."""
    srcs = [s for _, s in recvs]
    if len(set(srcs)) != len(srcs):
        raise CheckpointError(f"{what}: two transfers from one rank at once ({srcs})")
    out_files: List[List[Tuple[str, int]]] = []
    headers: Dict[int, Dict[str, Any]] = {}
    for d, dsts in sends:
        try:
            files = _files(d)
            header: Dict[str, Any] = {"files": [[n, s] for n, s in files]}
        except (OSError, CheckpointError) as e:
            files, header = [], {"error": f"rank {side.rank} cannot read {d}: {e}"}
        out_files.append(files)
        for dst in dsts:
            if dst in headers:
                raise CheckpointError(f"{what}: two transfers to rank {dst} at once")
            headers[dst] = header
    # one header per peer: what it will receive from us, and from each source what we will receive
    got = _exchange_headers(side, headers, srcs, what)
    incoming = [_Incoming(final, src, h) for (final, src), h in zip(recvs, got)]
    send_chunks = [_chunks(f) for f in out_files]
    recv_chunks = [_chunks(inc.files) for inc in incoming]
    send_crcs = [[0] * len(f) for f in out_files]
    send_ok = [True] * len(sends)
    handles = [[_open_or_none(os.path.join(d, n)) for n, _ in files] for (d, _), files in zip(sends, out_files)]
    try:
        rounds = max([len(c) for c in send_chunks + recv_chunks] or [0])
        for k in range(rounds):
            outgoing, incoming_bufs = [], []
            for si, chunks in enumerate(send_chunks):
                if k < len(chunks):
                    i, off, n = chunks[k]
                    buf = torch.empty(n, dtype=torch.uint8)
                    try:
                        h = handles[si][i]
                        h.seek(off)
                        if h.readinto(buf.numpy()) != n:
                            send_ok[si] = False
                    except (OSError, AttributeError):  # gone since it was listed: the receivers discard it
                        send_ok[si] = False
                    send_crcs[si][i] = isal_zlib.crc32(buf.numpy(), send_crcs[si][i])
                    outgoing += [(buf, dst) for dst in sends[si][1]]
            for ri, chunks in enumerate(recv_chunks):
                if k < len(chunks):
                    i, off, n = chunks[k]
                    buf = torch.empty(n, dtype=torch.uint8)
                    incoming_bufs.append((ri, i, off, buf))
            side.exchange(outgoing, [(b, recvs[ri][1]) for ri, _, _, b in incoming_bufs], what).wait()
            for ri, i, off, buf in incoming_bufs:
                incoming[ri].write(i, off, buf)
        # trailer: each file's CRC32 as the sender read it (-1: the sender's read failed)
        trailers = []
        for si, crcs in enumerate(send_crcs):
            t = torch.tensor([c if send_ok[si] else -1 for c in crcs] or [0], dtype=torch.int64)
            trailers += [(t, dst) for dst in sends[si][1]]
        tails = [torch.zeros(max(1, len(inc.files)), dtype=torch.int64) for inc in incoming]
        side.exchange(trailers, [(t, s) for t, s in zip(tails, srcs)], what).wait()
    finally:
        for hs in handles:
            for h in hs:
                if h is not None:
                    h.close()
    return [inc.finish([int(x) for x in t.tolist()][: len(inc.files)]) for inc, t in zip(incoming, tails)]


def _open_or_none(path: str) -> Any:
    try:
        return open(path, "rb")
    except OSError:
        return None


def _exchange_headers(side: Comm, headers: Dict[int, Dict[str, Any]], srcs: Sequence[int],
                      what: str) -> List[Dict[str, Any]]:
    """Send each destination its header, receive each source's."""
    import json

    datas = {d: json.dumps(h, separators=(",", ":")).encode() for d, h in headers.items()}
    lens = [torch.zeros(1, dtype=torch.int64) for _ in srcs]
    side.exchange([(torch.tensor([len(b)], dtype=torch.int64), d) for d, b in datas.items()],
                  list(zip(lens, srcs)), what).wait()
    bufs = [torch.empty(int(n.item()), dtype=torch.uint8) for n in lens]
    side.exchange([(torch.frombuffer(bytearray(b), dtype=torch.uint8), d) for d, b in datas.items()],
                  list(zip(bufs, srcs)), what).wait()
    out = []
    for src, b in zip(srcs, bufs):
        try:
            h = json.loads(bytes(b.numpy()))
        except ValueError:
            h = None
        ok = isinstance(h, dict) and (isinstance(h.get("error"), str) or (
            isinstance(h.get("files"), list)
            and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and type(f[1]) is int
                    and f[1] >= 0 for f in h["files"])))
        if not ok:  # the stream that follows cannot be matched: a bug or a hostile peer, never a retry
            raise CheckpointError(f"{what}: rank {src} sent a malformed header; the transfer stops")
        out.append(h)
    return out


# --------------------------------------------------------------------------------------
# after every local save: the background replication
# --------------------------------------------------------------------------------------
class Replicator:
    """One job's replication of its local tier (one per process): created and checked once, at the
    first local save (collective), then :meth:`start` after each local save commits."""

    def __init__(self, root: str, layout: str, jump: Optional[int], factor: int, comm: Comm) -> None:
        self.root, self.layout, self.factor = root, layout, int(factor)
        self.jump = resolve_jump(jump)
        self.rank = comm.rank
        self.group = replica_group(comm.rank, comm.world_size, self.jump, self.factor)
        self.peers = [p for p in self.group if p != comm.rank]
        self.side = Comm(side_group(), timeout=comm.timeout)  # the job's, not the side group's 30 min
        check_peers(comm, self.side, self.group, self.jump)
        self.thread: Optional[threading.Thread] = None
        self.broken: Optional[str] = None
        #: per round: (iteration, seconds, bytes sent per peer, errors)
        self.history: List[Dict[str, Any]] = []

    def wait(self) -> None:
        """Wait for the replication in flight (before the next local save touches the tier)."""
        if self.thread is not None:
            t0 = time.perf_counter()
            self.thread.join()
            self.thread = None
            waited = time.perf_counter() - t0
            if waited > 1.0:
                logger.info("waited %.1f s for the previous replication to finish", waited)

    def start(self, iteration: int) -> None:
        """Send this rank's committed version of ``iteration`` to its peers, and receive theirs, in
        the background. Every rank calls it after the same local saves."""
        self.wait()
        if self.broken or not self.peers:
            return
        self.thread = threading.Thread(target=self._run, args=(int(iteration),),
                                       name=f"megashard-replication-{iteration}", daemon=True)
        self.thread.start()

    def _run(self, iteration: int) -> None:
        t0 = time.perf_counter()
        own = localtier.version_dir(self.root, self.layout, self.rank, iteration)
        recvs = [(localtier.replica_version_dir(self.root, self.layout, p, iteration), p) for p in self.peers]
        try:
            errors = transfer(self.side, [(own, self.peers)], recvs, f"replication of iteration {iteration}")
        except DistributedError as e:  # a peer is gone: the round cannot be matched any more
            self.broken = str(e)
            logger.error("replication of iteration %d stopped (no further replication in this run): %s",
                         iteration, str(e)[:2000])
            return
        except Exception as e:  # noqa: BLE001 - a background thread: report, never raise into nothing
            self.broken = f"{type(e).__name__}: {e}"
            logger.error("replication of iteration %d failed (no further replication in this run): %s",
                         iteration, self.broken, exc_info=True)
            return
        size = sum(s for _, s in _files(own)) if os.path.isdir(own) else 0
        dt = time.perf_counter() - t0
        self.history.append({"iteration": iteration, "seconds": dt, "bytes": size,
                             "errors": [e for e in errors if e]})
        for e in errors:
            if e:
                logger.warning("replication of iteration %d: %s", iteration, e)
        logger.info("replicated iteration %d (%.1f MB) to rank%s %s in %.3f s", iteration, size / 1e6,
                    "s" if len(self.peers) > 1 else "", ",".join(map(str, self.peers)), dt)


# --------------------------------------------------------------------------------------
# restart
# --------------------------------------------------------------------------------------
def decide(reports: List[Dict[str, Any]], persistent: int, layout: str) -> List[Dict[str, Any]]:
    """Rank 0: from each rank's report (``own``: complete iterations; ``replicas``: {source rank:
    complete iterations this rank holds replicas of}; ``other``: :func:`localtier.other_layouts`),
    the iteration every rank resumes from and who sends whom its version; one reply per rank.
    None, with why, when no iteration is complete for every rank in this job's ``layout`` (a
    changed layout is named: versions of another are not resharded)."""
    world = len(reports)
    holders: Dict[int, Dict[int, List[int]]] = {}  # source -> iteration -> holder ranks
    for h, rep in enumerate(reports):
        for s, its in (rep.get("replicas") or {}).items():
            s = int(s)
            if 0 <= s < world and s != h:
                for it in its:
                    holders.setdefault(s, {}).setdefault(int(it), []).append(h)
    available = [sorted(set(rep["own"]) | set(holders.get(r, {}))) for r, rep in enumerate(reports)]
    it, why = localtier.choose(available, persistent)
    if it is None:
        why = localtier.layout_changed([rep.get("other") or {} for rep in reports], layout, persistent) or why
        return [{"iteration": None, "why": why}] * world
    fetch = {r: min(holders[r][it]) for r, rep in enumerate(reports) if it not in rep["own"]}
    serve: Dict[int, List[int]] = {}
    for r, h in fetch.items():
        serve.setdefault(h, []).append(r)
    return [{"iteration": it, "why": "", "fetch_from": fetch.get(r), "serve": serve.get(r, [])}
            for r in range(world)]


def resolve(comm: Comm, root: str, layout: str, persistent: int,
            replication: Optional[Tuple[Optional[int], int]] = None) -> Tuple[Optional[int], str]:
    """Collective: the iteration of the local tier the job resumes from, or (None, why not).

    Every rank reports its own complete versions and, with ``replication`` (jump, factor), the
    replicas it holds of its replica group's ranks; rank 0 picks the newest iteration complete for
    every rank (own or replica) newer than ``persistent``; each rank missing its own copy then gets
    it from a rank holding the replica (over the side group) into its own directory. On return
    every rank holds its own committed version of the iteration (or the job falls back: None).
    Versions saved in another world size or parallel layout are never used (why names the change)."""
    group: List[int] = []
    if replication is not None and replication[1] > 1:
        group = replica_group(comm.rank, comm.world_size, resolve_jump(replication[0]), int(replication[1]))

    def report() -> Dict[str, Any]:
        return {"own": localtier.complete_iterations(root, layout, comm.rank),
                "replicas": {str(s): localtier.complete_replica_iterations(root, layout, s)
                             for s in group if s != comm.rank},
                "other": localtier.other_layouts(root, layout)}

    rep, err = comm.run("load/local", report)
    reply = comm.coordinate("load (local checkpoint lookup)", err, rep,
                            lambda reports: decide(reports, persistent, layout))
    it = reply["iteration"]
    if it is None or not group:
        return it, reply["why"]
    # collective on every rank (same answer everywhere): whether anyone needs a peer's replica
    if not comm.all_reduce_max(1 if reply["fetch_from"] is not None or reply["serve"] else 0):
        return it, ""
    side = Comm(side_group(), timeout=comm.timeout)
    t0 = time.perf_counter()

    def fetch() -> None:
        if reply["fetch_from"] is not None:
            localtier.prepare(root, layout, comm.rank)
        sends = [(localtier.replica_version_dir(root, layout, s, it), [s]) for s in reply["serve"]]
        recvs = ([(localtier.version_dir(root, layout, comm.rank, it), int(reply["fetch_from"]))]
                 if reply["fetch_from"] is not None else [])
        errors = transfer(side, sends, recvs, f"restore of iteration {it} from a replica")
        if errors and errors[0]:
            raise CheckpointError(errors[0])
        if recvs:
            localtier.after_commit(root, layout, comm.rank, it)
            logger.info("restored rank %d's local checkpoint of iteration %d from rank %d's replica in %.3f s",
                        comm.rank, it, reply["fetch_from"], time.perf_counter() - t0)

    _, err = comm.run("load/local replica", fetch)
    try:
        comm.agree(err, "load (local checkpoint from a replica)")
    except DistributedError as e:
        return None, f"restoring iteration {it} from the replicas failed ({str(e)[:1000]})"
    return it, ""
