#!/usr/bin/env python
"""Drive megashard's save planning, index building and load planning for 1k-16k ranks in one process.

Every rank's sharded state is fabricated by ``scale_models.rank_state_dict`` (shapes,
offsets, flattened ranges and replica ids as megatron-core builds them; meta tensors, no
data). The functions are the ones ``megashard.save`` / ``megashard.load`` run:

* per rank: ``saving._make_save_hook`` + ``saving._tree_parts`` + ``saving.announce``
  (what a rank sends the coordinator), then ``saving._select`` + ``saving._write_job`` with a
  stand-in for the file writer (offsets laid out like a ``.tensors`` file, no bytes written);
* the coordinator (rank 0): ``saving.coordinate`` (validate + assign writers) and
  ``saving.build_index`` (the index);
* per sampled rank: ``manifest.LazyIndex`` over the index bytes, ``loading._decode_saved_tree``
  of its state tree, ``loading.plan_shard`` for every ShardedTensor of its template (own mode)
  and ``index.object`` for every ShardedObject.

A second, steady-state save of the same layout with other data (other CRC32s) follows: every
rank votes with the plan it cached (``saving.remember_plan`` / ``plan_vote`` / ``cached_reply``,
the plan cache ``save`` uses), the summed votes must agree and give every rank its first reply;
every rank's records must equal its first save's but for their CRC32s (``saving.records_digest``),
each sends ``saving.steady_commit`` (its CRC32s; not its records, nor its files, objects and tree
parts, which equal its first commit's), and rank 0 writes the first index's skeleton, the CRC32s
and the rest of the first index (``saving.build_index(..., skeleton)``), which must give the bytes
a full build of those records gives
(``steady_plan_reused``). ``rank0_s`` is everything rank 0 does in the first
save (its own announcement, decoding the plan gather, planning, encoding the replies,
decoding the commit gather, the index); ``rank0_steady_s`` the same for the steady-state save
(its vote, decoding the steady commit, writing the index from the skeleton); ``max_rank_recv_bytes`` what rank 0 receives in the
first save (the busiest rank), ``max_other_rank_recv_bytes`` what any other rank receives per
collective.

Seconds are CPU seconds of this process (``time.process_time``; it runs one thread, so a part's
CPU time is that part's work): on a shared machine wall times swing with its load. JSON in
``docs/scale/`` written before ``*_issue32.json`` holds wall seconds.

Message sizes are those ``transport.Comm.coordinate`` sends (a rank's ``transport.encode_message``,
a leader's ``pack_part``, rank 0's ``pack_replies``: each message its own size, plus 8 bytes of size
exchange). Model chunks are encoded once per ``scale_models.model_class`` (see :func:`_save_state`).
``coordinator_peak_mb`` is the peak resident memory rank 0's coordinator work adds on top of
the bytes it received (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``), the
largest of three windows (``coordinator_peak_mb_parts``): the plan (decoding the announcements,
planning, encoding the replies), the commit (decoding the commit messages, building the index)
and the steady-state commit. Each window starts with rank 0 holding the bytes it received, before
it decodes them (``*_decoded``: the decoded messages, part of the window), and holds none of what
the simulated other ranks make (issue 32: before, one window ran from the decoded announcements
to the index and held the simulated ranks' steady-state records too, and the freed announcements).

``--storage s3`` adds the object-store request counts of ``docs/s3design`` (the lead's design
note) for the simulated files and reads: per save, PUTs / multipart parts / LISTs / HEADs
(:func:`s3_save_requests`, exact, from the index's file table); per load, GETs in ``own``
mode (every rank: head, digest, the index (whole up to ``MEGASHARD_S3_INDEX_WHOLE_BYTES``, else
its last block and the ranged GETs of the blocks holding the sections it reads, through the load's own
block reader: ``s3_rank_index_read_bytes`` / ``s3_rank_index_gets``, the busiest sampled rank),
its data runs coalesced over gaps <= 1 MiB and cut into <= 16 MiB GETs) and in ``scatter`` mode (each node's reader:
head, digest, the whole index, the node's bytes once: each rank's runs of bytes only it needs by that rank, the
rest by the reader, :func:`s3_scatter_gets`), from the same load plans. Load
totals are exact when every rank (node) is sampled, else the sampled mean times the ranks
(nodes), marked ``est``.

``--load-bytes`` adds the bytes leaving storage for one same-layout load per mode (``own``,
``scatter``, ``readonce``), the job's total and the busiest node's (:func:`load_bytes_report`).

Usage: ``scripts/simulate_scale.py --model llama3-70b --tp 8 --pp 8 --dp 16 --distributed-optimizer
[--reshard-to TP,PP,DP[,EP]] [--sample 16] [--storage s3] [--load-bytes] [--ranks-per-node 8] [--json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scale_models as sm  # noqa: E402
from _bench_worker import _status_kib, release_free_memory, reset_peak_rss  # noqa: E402

from megashard import jsonstate, loading, manifest as mf, saving, scatter, transport  # noqa: E402
from megashard.storage.s3 import checkpoint as s3ck  # noqa: E402
from megashard.sharded import ShardedTensor, looks_like_sharded_object, looks_like_sharded_tensor, object_unique_key  # noqa: E402

_clock = time.process_time  # see the module docstring: CPU seconds, not wall seconds
SIZE_EXCHANGE = 8  # the int64 each rank sends/receives before a gather/scatter payload

# object-store constants of the design (defaults of MEGASHARD_S3_PART_BYTES / _GET_BYTES)
S3_PART_BYTES = 64 << 20  # a file larger than this is a multipart upload of parts this size
S3_GET_BYTES = 16 << 20  # one ranged GET at most
S3_GAP_BYTES = 1 << 20  # requests this close in one read are one GET (the gap read into scratch)
S3_PAGE = 1000  # keys per LIST page and per DeleteObjects batch

Range = Tuple[str, int, int]  # file, offset, nbytes


def _wire(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":")).encode())


def _fake_write(tensors: Dict[str, Any], path: str, align: int, fsync: bool,
                threads: Optional[int]) -> Tuple[List[Any], int, Dict[str, Any]]:
    """Stands in for ``format.write_file``: offsets laid out like a .tensors file (a metadata
    block, a header per tensor, data aligned to ``align``), nothing written."""
    pos = 4096 * (1 + (len(tensors) * 160) // 4096)
    infos = []
    for name, t in tensors.items():
        header = 64 + len(name.encode()) + 8 * t.dim()
        nbytes = t.numel() * t.element_size()
        data = pos + header + (-(pos + header)) % align if nbytes else pos + header
        infos.append(SimpleNamespace(name=name, header_offset=pos, data_offset=data, nbytes=nbytes,
                                     crc32=(data * 2654435761) & 0xFFFFFFFF))
        pos = data + nbytes
    return infos, pos + 8, {}


def _fake_write_steady(tensors: Dict[str, Any], path: str, align: int, fsync: bool,
                       threads: Optional[int]) -> Tuple[List[Any], int, Dict[str, Any]]:
    """``_fake_write`` of other data: the same offsets, other CRC32s, which differ from rank to
    rank (from file to file) as real data's do: replicas' equal CRC32 lists would be sent once
    by their group's leader (``transport.pack_part``), understating what rank 0 receives."""
    infos, size, extra = _fake_write(tensors, path, align, fsync, threads)
    salt = zlib.crc32(os.path.basename(path).encode())
    for i in infos:
        i.crc32 = ((i.crc32 * 40503 + 12345) ^ salt) & 0xFFFFFFFF
    return infos, size, extra


ModelPart = Dict[str, Tuple[Any, list, list]]  # model key -> (encoded subtree, its shards, its objects)


def _save_state(model: str, layout: sm.Layout, rank: int, quirk: bool,
                models: Optional[Dict[Any, ModelPart]] = None) -> saving._SaveState:
    """What ``saving.save``'s ``prepare`` builds on ``rank`` (``jsonstate.encode`` with
    ``saving._make_save_hook``, then ``saving._tree_parts``). With ``models`` (a cache by
    ``scale_models.model_class``), the model chunks are encoded once per class and their encoded
    subtree, shards and objects reused for the class's other ranks: encoding a state dict's
    top-level keys one by one (same paths, same hook) is what encoding the dict does, and the
    class's ranks differ in the model chunks only in the data-parallel index of replica ids, which a
    save reads only as main replica or not (``tests/test_simulate_scale.py`` compares the results
    with whole encodings for every rank of small layouts)."""
    st = saving._SaveState(rank)
    hook = saving._make_save_hook(st, sm.file_stems(model, layout, rank))
    if models is None:
        sd = sm.rank_state_dict(model, layout, rank, swiglu_dist_opt_quirk=quirk)
        st.tree = jsonstate.encode(dict(sd), hook=hook)
    else:
        sd = sm.rank_state_dict(model, layout, rank, swiglu_dist_opt_quirk=quirk, with_model=False)
        cls = sm.model_class(layout, rank)
        part = models.get(cls)
        if part is None:
            if models and next(iter(models))[1] != cls[1]:
                models.clear()  # ranks come in order, pipeline stage outermost: keep one stage's classes
            full = sm.rank_state_dict(model, layout, rank, swiglu_dist_opt_quirk=quirk)
            part = {}
            for k in sm.model_keys(model, layout):
                n, m = len(st.shards), len(st.objects)
                part[k] = (jsonstate.encode(full[k], path=k, hook=hook), st.shards[n:], st.objects[m:])
                del st.shards[n:], st.objects[m:]
            assert not st.local, "rank-local tensors in a model chunk: encode every rank whole"
            models[cls] = part
        tree: Dict[str, Any] = {}
        for k, v in sd.items():
            if k in part:
                enc, shards, objects = part[k]
                tree[k] = enc
                st.shards += shards
                st.objects += objects
            else:
                tree[k] = jsonstate.encode(v, path=k, hook=hook)
        st.tree = tree
    st.tree_parts = saving._tree_parts(st, rank)
    return st


class _Tree:
    """The gather of ``transport.Comm.coordinate`` as the job runs it (groups of ``group`` ranks;
    a group's first rank leads it), with its real encoders: rank 0 decodes its own group's
    messages and the other leaders' parts (:func:`transport.unpack_part`); each leader packs its
    group (:func:`transport.pack_part`) and unpacks its replies. Fed one rank's message at a time,
    it keeps one group's texts; times are rank 0's (``rank0_s``) and the slowest leader's."""

    def __init__(self, world: int, group: int) -> None:
        self.world, self.group = world, group
        self.recv = [0] * -(-world // group)  # bytes each leader (index: group) receives; [0]: rank 0
        self.leader_s = [0.0] * len(self.recv)

    def gather(self, texts_of_ranks: Any) -> Tuple[List[Any], float, List[int]]:
        """Every rank's payload on rank 0 (in rank order), rank 0's decode seconds, and the
        bytes each rank sends."""
        own, parts, sent = self.collect(texts_of_ranks)
        payloads, decode = self.decode(own, parts)
        return payloads, decode, sent

    def _groups(self, texts_of_ranks: Any, sent: List[int]) -> Iterator[Tuple[int, List[bytes]]]:
        """Each group's messages in turn (group number, texts), counting the bytes each rank
        sends (into ``sent``) and each leader receives."""
        texts: List[bytes] = []
        for r, text in enumerate(texts_of_ranks):
            texts.append(text)
            sent.append(len(text) + SIZE_EXCHANGE)
            if len(texts) == self.group or r == self.world - 1:
                g = r // self.group
                self.recv[g] += sum(len(t) + SIZE_EXCHANGE for t in texts[1:])
                yield g, texts
                texts = []

    def _up(self, g: int, part: bytes, members: int, t1: float, sent: List[int], parts: List[bytes]) -> None:
        """Leader ``g`` (which began at ``t1``) sends rank 0 ``part`` for its ``members`` ranks."""
        self.leader_s[g] += _clock() - t1
        sent[-members] = len(part) + SIZE_EXCHANGE
        self.recv[0] += len(part) + SIZE_EXCHANGE
        parts.append(part)

    def collect(self, texts_of_ranks: Any) -> Tuple[List[bytes], List[bytes], List[int]]:
        """What rank 0 receives: its own group's messages and the other leaders' parts (each
        leader packs its group, :func:`transport.pack_part`); and the bytes each rank sends."""
        own: List[bytes] = []
        parts: List[bytes] = []
        sent: List[int] = []
        for g, texts in self._groups(texts_of_ranks, sent):
            if g == 0:
                own = texts
            else:
                t1 = _clock()
                self._up(g, transport.pack_part(texts), len(texts), t1, sent, parts)
        return own, parts, sent

    def collect_led(self, texts_of_ranks: Any, lead: Callable[[int], Any] = lambda base: saving._SaveLead(base),
                    keep: bool = True) -> Tuple[List[bytes], List[bytes], List[int], List[bytes]]:
        """A gather with ``lead`` (``Comm.coordinate(..., lead=...)``; the plan's: ``saving._SaveLead``,
        the first commit's: ``saving._CommitLead``): each other leader decodes its group's messages,
        condenses them (``lead(its first rank).reduce``) and sends rank 0 one part
        (:func:`transport.pack_led_part`), timed as that leader's. Returns rank 0's own group's
        messages, the parts, the bytes each rank sends, and (``keep``) each group's messages
        zlib-compressed (kept by the simulation, outside rank 0's memory window, to expand the
        plan's replies and to vote later)."""
        own: List[bytes] = []
        parts: List[bytes] = []
        sent: List[int] = []
        stored: List[bytes] = []
        for g, texts in self._groups(texts_of_ranks, sent):
            if keep:
                stored.append(zlib.compress(b"".join(len(t).to_bytes(8, "little") + t for t in texts), 1))
            if g == 0:
                own = texts
            else:
                t1 = _clock()
                with transport.gc_paused():
                    errors, payloads = transport.unpack_messages(texts)
                    assert not errors
                    part = transport.pack_led_part({"part": lead(g * self.group).reduce(payloads)})
                del payloads
                self._up(g, part, len(texts), t1, sent, parts)
        return own, parts, sent, stored

    def expand_led(self, stored: List[bytes], down: List[bytes], own_replies: List[Any], own_payloads: List[Any],
                   own_texts: List[bytes]) -> Tuple[List[Any], List[Any], List[int]]:
        """Each other leader receives its group's reply, expands it (``plan.PlanLead.expand``, timed
        as that leader's) and sends each member its reply. Returns every rank's reply and
        announcement (rank order) and the bytes each rank receives."""
        replies: List[Any] = list(own_replies)
        messages: List[Any] = list(own_payloads)
        recv = [0] + [len(t) + SIZE_EXCHANGE for t in own_texts]
        for g in range(1, len(stored)):
            raw = zlib.decompress(stored[g])
            texts, pos = [], 0
            while pos < len(raw):
                n = int.from_bytes(raw[pos:pos + 8], "little")
                texts.append(raw[pos + 8:pos + 8 + n])
                pos += 8 + n
            _errors, payloads = transport.unpack_messages(texts)
            lead = saving._SaveLead(g * self.group)
            lead.reduce(payloads)  # the leader's state from its reduce (timed in collect_led)
            self.recv[g] += len(down[g - 1]) + SIZE_EXCHANGE
            t1 = _clock()
            with transport.gc_paused():
                mine = lead.expand(json.loads(zlib.decompress(down[g - 1]))["ok"], payloads)
                out = [transport._dumps_bytes({"ok": r}) for r in mine[1:]]
            self.leader_s[g] += _clock() - t1
            recv += [len(down[g - 1]) + SIZE_EXCHANGE] + [len(t) + SIZE_EXCHANGE for t in out]
            replies += mine
            messages += payloads
        return replies, messages, recv

    @staticmethod
    def decode(own: List[bytes], parts: List[bytes]) -> Tuple[List[Any], float]:
        """Rank 0's decoding as ``transport.Comm.coordinate`` does it (every part decoded while
        all are held, under one ``gc_paused``; ``own`` and ``parts`` are emptied, as it drops
        them): the payloads, in rank order, and rank 0's seconds."""
        t1 = _clock()
        with transport.gc_paused():
            errors, payloads = transport.unpack_messages(own)
            assert not errors
            for p in parts:
                errors, got = transport.unpack_part(p)
                assert not errors
                payloads += got
        own.clear()
        parts.clear()
        return payloads, _clock() - t1

    def scatter(self, replies: Sequence[Any]) -> Tuple[float, List[int]]:
        """Rank 0 sends the replies down; its encode seconds and the bytes each rank receives
        (its reply; a leader also the group's part)."""
        t1 = _clock()
        own = [transport._dumps_bytes(r) for r in replies[:self.group]]
        parts = [transport.pack_replies(replies[g:g + self.group]) for g in range(self.group, self.world, self.group)]
        encode = _clock() - t1
        recv = [len(t) + SIZE_EXCHANGE for t in own]
        for g, part in enumerate(parts, 1):
            self.recv[g] += len(part) + SIZE_EXCHANGE
            t1 = _clock()
            texts = transport.unpack_replies(part)
            self.leader_s[g] += _clock() - t1
            recv += [len(t) + SIZE_EXCHANGE for t in texts]
        recv[0] = 0
        return encode, recv

    def busiest(self) -> Tuple[int, int]:
        """(rank, bytes) of the leader (rank 0 included) that receives the most."""
        g = max(range(len(self.recv)), key=self.recv.__getitem__)
        return g * self.group, self.recv[g]


class _Peak:
    """Rank 0's coordinator memory in one window of work: the peak resident memory above the
    memory held when it starts (freed heap returned to the OS first, then ``VmHWM`` reset through
    ``/proc/self/clear_refs``). A window starts when rank 0 holds the bytes it received, before it
    decodes them, and holds nothing the simulated other ranks made meanwhile."""

    def __init__(self) -> None:
        release_free_memory()
        self.base = _status_kib("VmRSS") * 1024
        self.ok = reset_peak_rss()

    def now(self) -> float:
        """MB held above the start now."""
        return round(max(0, _status_kib("VmRSS") * 1024 - self.base) / 2**20, 1)

    def peak(self) -> Optional[float]:
        """MB of the peak above the start so far (None: the peak cannot be reset here)."""
        return round(max(0, _status_kib("VmHWM") * 1024 - self.base) / 2**20, 1) if self.ok else None


def simulate_save(model: str, layout: sm.Layout, quirk: bool = False, group: Optional[int] = None) -> Dict[str, Any]:
    """Every rank announces; the coordinator plans; every rank "writes"; the coordinator
    builds the index. Then the same save again as a steady-state save: every rank votes
    with the plan it cached (``saving.plan_vote``), the votes must agree and give every rank
    the reply it had; rank 0 decodes the commit and builds the index again. The gathers run
    through groups of ``group`` ranks (default: ``transport.gather_group_size``; the world:
    one flat gather). Returns the figures and the index bytes."""
    world = layout.world
    group = transport.gather_group_size(world) if group is None else max(1, min(group, world))
    tree = _Tree(world, group)
    t_rank0_own = 0.0  # rank 0's own state, announcement and vote
    models: Dict[Any, ModelPart] = {}  # _save_state's cache of encoded model chunks

    def announcements() -> Any:
        nonlocal t_rank0_own
        for r in range(world):
            t1 = _clock()
            st = _save_state(model, layout, r, quirk, models)
            msg = saving.announce(st, r)
            text = transport.encode_message(None, msg)
            if r == 0:
                t_rank0_own += _clock() - t1
            yield text

    t0 = _clock()
    own, parts, send, stored = tree.collect_led(announcements())
    t_announce = _clock() - t0

    # the plan as Comm.coordinate(..., lead=saving._SaveLead) runs it on rank 0: its own group's
    # messages decoded and condensed, the other leaders' parts decoded, the plan over the parts
    # (saving.coordinate_parts), one reply per group encoded, its own group's replies expanded
    mem_plan = _Peak()  # rank 0 holds what it received: its group's messages and the leaders' parts
    with transport.gc_paused():
        t0 = _clock()
        errors, own_payloads = transport.unpack_messages(own)
        assert not errors
        own.clear()
        t_decode = _clock() - t0
        t0 = _clock()
        lead0 = saving._SaveLead(0)
        got = [lead0.reduce(own_payloads)]
        t_reduce0 = _clock() - t0
        t0 = _clock()
        got += [transport.unpack_led_part(p)["part"] for p in parts]
        parts.clear()
        t_decode += _clock() - t0
        plan_decoded = mem_plan.now()
        t0 = _clock()
        keep = saving._Coordinator()
        group_replies = saving.coordinate_parts(got, "simulated", keep)
        del got
        t_plan = _clock() - t0
        t0 = _clock()
        down = [zlib.compress(transport._dumps_bytes({"ok": r}), transport.PART_ZLIB_LEVEL) for r in group_replies[1:]]
        own_replies = lead0.expand(group_replies[0], own_payloads)
        own_texts = [transport._dumps_bytes({"ok": r}) for r in own_replies[1:]]
        t_encode = _clock() - t0
    plan_peak = mem_plan.peak()  # (rank 0 then drops the parts and the plan's state)
    plan_recv0 = tree.recv[0]  # rank 0's bytes of the plan gather (its scatter receives nothing)
    del group_replies, lead0
    replies, messages, recv = tree.expand_led(stored, down, own_replies, own_payloads, own_texts)
    del down, own_replies, own_payloads, own_texts, stored

    # the steady-state save's plan: each rank's vote with the plan it cached, summed as the all-reduce does
    t0 = _clock()
    total = [0, 0, 0]
    steady_replies_ok = True
    steady_replies: List[Dict[str, Any]] = []
    for r in range(world):
        t1 = _clock()
        entry = saving.remember_plan(messages[r], replies[r], keep.tensors if r == 0 else None)
        vote = saving.plan_vote(entry, messages[r], r, world)
        reuse = saving.cached_reply(entry, messages[r])
        steady_replies.append(reuse)
        if r == 0:
            t_rank0_own += _clock() - t1
            t_vote0 = _clock() - t1
        total = [a + b for a, b in zip(total, vote)]
        steady_replies_ok &= all(reuse[k] == replies[r][k] for k in ("write", "objects", "blobs"))
    t_votes = _clock() - t0
    agreed = saving.plan_agreed(total)
    del messages
    leader_plan_s = max(tree.leader_s[1:] or [0.0])

    digests_same = True
    steady_results: List[Dict[str, Any]] = []
    steady_texts: List[bytes] = []

    def commits() -> Any:
        nonlocal digests_same
        for r in range(world):
            st = _save_state(model, layout, r, quirk, models)
            saving.announce(st, r)  # sets the shard order the reply indexes
            job = saving._select(st, replies[r])
            res = saving._write_job(job, "/nonexistent", r, 4096, False, None, write=_fake_write)
            # the steady-state save: the same layout, other data (other CRC32s); the rank sends its CRC32s only
            st = _save_state(model, layout, r, quirk, models)
            saving.announce(st, r)
            job = saving._select(st, steady_replies[r])
            res2 = saving._write_job(job, "/nonexistent", r, 4096, False, None, write=_fake_write_steady)
            digests_same &= saving.records_digest(res2["records"]) == saving.records_digest(res["records"])
            steady_results.append(res2)
            steady_texts.append(transport.encode_message(None, saving.steady_commit(res2, saving.meta_digests(res))))
            yield transport.encode_message(None, res)

    t0 = _clock()
    # the first commit as Comm.coordinate(..., lead=saving._CommitLead()) runs it: each leader groups its
    # members' records by chunk (saving.commit_part); rank 0 decodes its own group's messages and groups
    # them, decodes the other leaders' parts and lays the index out from the parts
    own, parts, commit_send, _ = tree.collect_led(commits(), lambda base: saving._CommitLead(), keep=False)
    t_write = _clock() - t0
    mem_commit = _Peak()  # rank 0 holds the commit messages and parts it received (and its plan's keep)
    with transport.gc_paused():
        t0 = _clock()
        errors, own_payloads = transport.unpack_messages(own)
        assert not errors
        own.clear()
        got: List[Any] = [{"part": saving._CommitLead().reduce(own_payloads)}] + parts
        del own_payloads
        parts.clear()
        t_decode_commit = _clock() - t0
    commit_decoded = mem_commit.now()  # its own group's part decoded; the others' as the index reaches them
    t_commit_encode, _ = tree.scatter([{"ok": 0}] * world)
    first_recv = tree.recv[:]
    leader_s = max(tree.leader_s[1:] or [0.0])

    decoding = [0.0]

    def timed(it: Iterator[Any]) -> Iterator[Any]:
        """transport's streamed parts (``_CommitLead.streams``), the seconds spent decoding them counted apart."""
        while True:
            t1 = _clock()
            p = next(it, None)
            decoding[0] += _clock() - t1
            if p is None:
                return
            yield p
            del p

    t0 = _clock()
    layout_doc = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    head, sections, skeleton = saving.build_index_from_parts(timed(transport._decoded_parts(got)), keep.tensors,
                                                             world, layout_doc)
    t_index = _clock() - t0 - decoding[0]
    t_decode_commit += decoding[0]
    t_write += t_decode_commit
    commit_peak = mem_commit.peak()
    del got
    steady_tree = _Tree(world, group)
    own, parts, steady_send = steady_tree.collect(iter(steady_texts))
    steady_texts = []
    mem_steady = _Peak()  # rank 0 holds the steady commit messages, and the first index's skeleton
    steady_msgs, t_decode_steady = steady_tree.decode(own, parts)
    t0 = _clock()  # the steady-state save's commit: the CRC32s into the skeleton
    head2, sections2, _ = saving.build_index(steady_msgs, keep.tensors, world, layout_doc, skeleton)
    t_index_steady = _clock() - t0
    steady_peak = mem_steady.peak()
    del steady_msgs
    # the same index as a full build of the steady-state save's records (not timed)
    head3, sections3, _ = saving.build_index_from_parts([saving.commit_part(steady_results[g:g + group])
                                                         for g in range(0, world, group)],
                                                        keep.tensors, world, layout_doc)
    same_index = sections2 == sections3 and sections2 != sections and digests_same
    steady_results = []
    del head2, sections2, head3, sections3
    rank0 = t_rank0_own + t_decode + t_reduce0 + t_plan + t_encode + t_decode_commit + t_commit_encode + t_index
    rank0_steady = t_vote0 + t_decode_steady + t_index_steady
    busiest_rank, busiest = tree.busiest()
    steady_busiest = max(steady_tree.recv) + 8 * 4  # the steady commit and the two votes
    return {
        "world": world,
        # the figures (seconds and bytes of rank 0 / of the busiest rank)
        "rank0_s": round(rank0, 3),
        "rank0_steady_s": round(rank0_steady, 3),
        "max_rank_recv_bytes": busiest,  # the busiest rank (rank 0 or a group leader), first save
        "max_rank_recv_bytes_steady": steady_busiest,
        "busiest_rank": busiest_rank,
        "rank0_recv_bytes": first_recv[0],
        "rank0_recv_bytes_parts": {"plan": plan_recv0, "commit": first_recv[0] - plan_recv0},
        "gather_group": group,
        "gather_groups": len(tree.recv),
        "leader_max_s": round(leader_s, 3),  # the slowest other leader: packing its group's parts, unpacking replies
        "leader_max_plan_s": round(leader_plan_s, 3),
        "rank0_parts_s": {"own": round(t_rank0_own, 3), "decode_plan": round(t_decode, 3), "plan": round(t_plan, 3),
                          "reduce_own": round(t_reduce0, 3), "encode_replies": round(t_encode, 3), "decode_commit": round(t_decode_commit, 3),
                          "encode_commit_replies": round(t_commit_encode, 3),
                          "index": round(t_index, 3), "steady_vote": round(t_vote0, 6),
                          "steady_decode_commit": round(t_decode_steady, 3),
                          "steady_index": round(t_index_steady, 3)},
        "steady_plan_reused": bool(agreed and steady_replies_ok and same_index),
        "steady_votes_s_all_ranks": round(t_votes, 2),
        "announce_s_all_ranks": round(t_announce, 2),
        "coordinator_plan_s": round(t_plan, 3),
        "coordinator_index_s": round(t_index, 3),
        "coordinator_s": round(t_plan + t_index, 3),
        "coordinator_decode_s": round(t_decode + t_decode_commit, 3),
        "coordinator_peak_mb": max(plan_peak, commit_peak, steady_peak) if mem_plan.ok else None,
        "coordinator_peak_mb_parts": {"plan": plan_peak, "plan_decoded": plan_decoded, "commit": commit_peak,
                                      "commit_decoded": commit_decoded, "steady": steady_peak},
        "coordinator_recv_bytes": first_recv[0],
        "max_rank_send_bytes": {"save/plan": max(send), "save/commit": max(commit_send),
                                "save/commit steady": max(steady_send)},
        "max_other_rank_recv_bytes": {"save/plan": max(recv[1:] or recv),
                                      "save/commit": 16 + SIZE_EXCHANGE, "save/plan steady": 8 * 3 + 32},
        "write_records_s_all_ranks": round(t_write, 2),
        "index_bytes": len(head) + len(sections),
        "index_head_bytes": len(head),
        "_head": head,
        "_sections": sections,
    }


def _leaves(x: Any) -> List[Any]:
    out, stack = [], [x]
    while stack:
        v = stack.pop()
        if looks_like_sharded_tensor(v) or looks_like_sharded_object(v):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return out


def plan_rank(head: bytes, sections: bytes, model: str, layout: sm.Layout, rank: int, quirk: bool = False,
              rows_ok: bool = True, ranges: bool = False, s3_index: bool = False) -> Dict[str, Any]:
    """One rank's load planning against the index (own mode; ``rows_ok=False``: as a scatter
    load plans): what it reads of the index, how long parse + plan take, bytes needed vs
    read, temporaries; with ``ranges``, also the byte ranges it reads (``ranges``) and its
    index section reads (``section_reads``: lengths). ``s3_index``: its index reads go through
    the object store's block reader (``s3ck.IndexBlocks``, as an own load on S3 reads an index
    above ``MEGASHARD_S3_INDEX_WHOLE_BYTES``): ``s3_index_gets`` and ``s3_index_bytes`` (bytes
    transferred, gaps a GET spans included); the whole index in one GET below that size."""
    template = sm.rank_state_dict(model, layout, rank, swiglu_dist_opt_quirk=quirk)
    section_reads: List[int] = []
    fetches: List[List[Range]] = []
    blocks = None
    if s3_index and len(sections) > s3ck.index_whole_bytes():
        def fetch(reqs: List[Tuple[int, memoryview]]) -> None:
            fetches.append([("index", o, len(v)) for o, v in reqs])
            for o, v in reqs:
                v[:] = sections[o:o + len(v)]

        blocks = s3ck.IndexBlocks(len(sections), fetch, "simulated")
        blocks.read_into([(len(sections) - 1, memoryview(bytearray(1)))])  # the last block, with the digest

    def read_section(s: int, n: int) -> bytes:
        section_reads.append(n)
        if blocks is not None:
            out = bytearray(n)
            blocks.read_into([(s, memoryview(out))])
            return bytes(out)
        return sections[s:s + n]

    t0 = _clock()
    index = mf.LazyIndex(mf.parse_head(head, "simulated"), read_section, "simulated", len(head))
    work = loading._LoadWork(rows_ok=rows_ok)
    loading._decode_saved_tree(index.tree_for_rank(rank), index, work, lazy=True)
    needed = read = temps = 0
    problems: List[str] = []
    spans: List[Range] = []
    for leaf in _leaves(template):
        if looks_like_sharded_object(leaf):
            if index.has_object(object_unique_key(leaf)):
                index.object(object_unique_key(leaf))
            continue
        sh = ShardedTensor.from_any(leaf)
        isz = sh.data.element_size()
        needed += ((sh.flat_range[1] - sh.flat_range[0]) if sh.flat_range else sh.data.numel()) * isz
        boxes, probs = loading.plan_shard(sh, index, rows_ok=rows_ok)
        problems += probs
        for bp in boxes:
            read += bp.wp.read_bytes + sum(rr.run_bytes * _prod(rr.lead_shape) for rr in bp.wp.rows)
            temps += sum(bp.wp.buffers) * isz
            if ranges:
                spans += [(r.file, r.file_offset, r.nbytes) for r in bp.wp.reads]
                spans += [(rr.file, off, rr.run_bytes) for rr in bp.wp.rows for off, _ in rr.runs()]
    out = {"rank": rank, "plan_s": _clock() - t0, "index_read_bytes": index.bytes_read,
           "needed_bytes": needed, "read_bytes": read, "temp_bytes": temps, "problems": problems[:5]}
    if ranges:
        out.update(ranges=spans, section_reads=section_reads)
    if s3_index:
        out["s3_index_gets"] = sum(s3_range_gets(f) for f in fetches) if blocks is not None else 1
        out["s3_index_bytes"] = (sum(hi - lo for f in fetches for lo, hi in _runs(f, S3_GAP_BYTES))
                                 if blocks is not None else len(sections))
    return out


def _prod(s: Sequence[int]) -> int:
    n = 1
    for d in s:
        n *= d
    return n


def _pages(n: int) -> int:
    return max(1, -(-n // S3_PAGE))


def s3_save_requests(file_bytes: Sequence[int], part_bytes: int = S3_PART_BYTES) -> Dict[str, Dict[str, int]]:
    """Requests of one save of these data files, by step (megashard.storage.s3.checkpoint):
    rank 0's plan (LIST of the prefix), the writers' uploads (a PUT per file up to one part,
    else MPU create + ceil(size/part) parts + complete), rank 0's commit (LIST of the save's
    prefix, PUT of index, digest and head), the clean-up (LIST of the prefix, upload listing),
    a re-save's extra (GET of the old head; removal of the replaced prefix: its files and the
    two index objects, LIST pages + DeleteObjects batches), and the tracker PUT."""
    up = {"PUT": 0, "MPU_CREATE": 0, "MPU_PART": 0, "MPU_COMPLETE": 0}
    for n in file_bytes:
        if n <= part_bytes:
            up["PUT"] += 1
        else:
            up["MPU_CREATE"] += 1
            up["MPU_PART"] += -(-n // part_bytes)
            up["MPU_COMPLETE"] += 1
    files = len(file_bytes)
    return {"plan": {"LIST": 1}, "upload": up, "commit": {"LIST": _pages(files), "PUT": 3},
            "cleanup": {"LIST": 1, "MPU_LIST": 1},
            "resave_extra": {"GET": 1, "LIST": _pages(files + 2), "DELETE": _pages(files + 2)}, "tracker": {"PUT": 1}}


def _runs(ranges: Sequence[Range], gap: int) -> List[Tuple[int, int]]:
    """``ranges`` merged per file into runs: requests no more than ``gap`` apart (or overlapping)
    are one run."""
    by_file: Dict[str, List[Tuple[int, int]]] = {}
    for f, a, n in ranges:
        if n > 0:
            by_file.setdefault(f, []).append((a, a + n))
    runs: List[Tuple[int, int]] = []
    for spans in by_file.values():
        spans.sort()
        lo, hi = spans[0]
        for a, b in spans[1:]:
            if a - hi <= gap:
                hi = max(hi, b)
                continue
            runs.append((lo, hi))
            lo, hi = a, b
        runs.append((lo, hi))
    return runs


def s3_range_gets(ranges: Sequence[Range], gap: int = S3_GAP_BYTES, get_bytes: int = S3_GET_BYTES) -> int:
    """GETs of reading ``ranges`` with one ``read_into`` per file: requests no more than ``gap``
    apart (or overlapping) are one run, each run ``ceil(len / get_bytes)`` GETs."""
    return sum(-(-(hi - lo) // get_bytes) for lo, hi in _runs(ranges, gap))


def s3_own_gets(ranges: Sequence[Range], index_gets: Optional[int] = None) -> Dict[str, int]:
    """One rank's requests in an own load: head, digest and the whole index (3 GETs) or, with
    ``index_gets`` (an index above ``MEGASHARD_S3_INDEX_WHOLE_BYTES``), head, digest (2 GETs) and
    the index's ranged block GETs (``index``: its last block with the digest, then the blocks holding
    the sections it reads); one HEAD per file it reads from (size and ETag, before allocating), its
    data runs."""
    files = len({f for f, _o, n in ranges if n})
    if index_gets is None:
        return {"GET": 3, "HEAD": files, "data": s3_range_gets(ranges)}
    return {"GET": 2, "HEAD": files, "index": index_gets, "data": s3_range_gets(ranges)}


def s3_scatter_gets(per_rank: Sequence[Sequence[Range]]) -> Dict[str, int]:
    """A node's requests in a scatter load (``per_rank``: each rank's ranges, the reader's first): the
    reader's head, digest and the whole index (3 GETs; it sends the index to the node's ranks), one
    HEAD per file its own plan reads (the node's other files are checked by the GETs themselves); the
    data as :mod:`megashard.scatter` splits it: each rank's runs of bytes only it needs, GETs of its
    own where :func:`megashard.scatter._read_alone` leaves them to it (``data_ranks``: those of the
    node's other ranks), and the rest, every byte once, through the reader's coalesced ring GETs
    (``data``: the reader's, its own runs included)."""
    ranges = [x for rr in per_rank for x in rr]
    owners = [r for r, rr in enumerate(per_rank) for _ in rr]
    ring: List[Range] = []
    alone: List[Tuple[int, Any]] = []
    for (f, a, _), r, pieces in zip(ranges, owners, scatter.split_shared(ranges)):
        for pos, n, shared in pieces:
            if shared:
                ring.append((f, a + pos, n))
            else:
                alone.append((r, (f, a + pos, n, 0, 0)))
    own: Dict[int, List[Range]] = {}
    for (r, d), itself in zip(alone, scatter._read_alone(alone, ranges, S3_GAP_BYTES)):
        if itself:
            own.setdefault(r, []).append(d[:3])
        else:
            ring.append(d[:3])
    ranks = sum(s3_range_gets(rr) for r, rr in own.items() if r != 0)
    data = s3_range_gets(ring) + s3_range_gets(own.get(0, []))
    return {"GET": 3, "HEAD": len({f for f, _o, n in per_rank[0] if n}), "data": data, "data_ranks": ranks}


def _total(per: Sequence[Dict[str, int]], count: int) -> Dict[str, Any]:
    """Summed by kind (and ``total``): exact when ``per`` covers all ``count``, else the mean
    times ``count``, marked ``est``."""
    sums = {k: sum(p[k] for p in per) for k in per[0]}
    sums["total"] = sum(sums.values())
    if len(per) >= count:
        return sums
    return {k: f"{round(v / len(per) * count)} (est)" for k, v in sums.items()}


def s3_report(head: bytes, sections: bytes, model: str, layout: sm.Layout, sample: int,
              ranks_per_node: int) -> Dict[str, Any]:
    """The object-store request counts of one save and of loads of it (same layout)."""
    index = mf.LazyIndex(mf.parse_head(head, "simulated"), lambda s, n: sections[s:s + n], "simulated", len(head))
    sizes = sorted(int(info.get("bytes", 0)) for info in index.files.values())
    per_rank: Dict[int, List[int]] = {}
    for info in index.files.values():
        per_rank.setdefault(int(info["rank"]), []).append(int(info.get("bytes", 0)))
    save = s3_save_requests(sizes)
    world = layout.world
    own = [plan_rank(head, sections, model, layout, r, ranges=True, s3_index=True) for r in _sample(world, sample)]
    ranged = len(sections) > s3ck.index_whole_bytes()
    own_gets = [s3_own_gets(p["ranges"], p["s3_index_gets"] if ranged else None) for p in own]
    nodes = -(-world // ranks_per_node)
    node_gets = []
    for nd in _sample(nodes, sample):
        members = range(nd * ranks_per_node, min(world, (nd + 1) * ranks_per_node))
        ranges = [plan_rank(head, sections, model, layout, r, rows_ok=False, ranges=True)["ranges"] for r in members]
        node_gets.append(s3_scatter_gets(ranges))
    return {
        "s3_files": len(sizes),
        "s3_save_requests": save,
        "s3_save_total": sum(sum(v.values()) for k, v in save.items() if k != "resave_extra"),
        "s3_save_max_rank_uploads": max(sum(v.values()) for v in
                                        (s3_save_requests(b)["upload"] for b in per_rank.values())),
        "s3_index_whole_bytes": s3ck.index_whole_bytes(),  # MEGASHARD_S3_INDEX_WHOLE_BYTES: above it, ranged
        "s3_index_block_bytes": s3ck.index_block_bytes(),
        "s3_rank_index_read_bytes": max(p["s3_index_bytes"] for p in own),  # what leaves the store per rank
        "s3_rank_index_gets": max(p["s3_index_gets"] for p in own),
        "s3_rank_index_read_bytes_whole": len(sections),  # one GET of the whole index (below the threshold)
        "s3_job_index_read_bytes": _total([{"bytes": p["s3_index_bytes"]} for p in own], world)["bytes"],
        "s3_load_own_gets": _total(own_gets, world),
        "s3_load_own_max_rank_gets": max(sum(g.values()) for g in own_gets),
        "s3_load_scatter_gets": _total(node_gets, nodes),
        "s3_load_scatter_max_reader_gets": max(sum(v for k, v in g.items() if k != "data_ranks")
                                               for g in node_gets),
        "s3_ranks_per_node": ranks_per_node,
    }


def _union_bytes(ranges: Sequence[Range]) -> int:
    """Bytes covered by ``ranges`` (file, offset, nbytes), overlaps counted once."""
    return sum(hi - lo for lo, hi in _runs(ranges, 0))


def _largest_first(sizes: Sequence[int], bins: int) -> int:
    """The fullest of ``bins`` after placing ``sizes`` largest first on the emptiest (whole files over nodes)."""
    import heapq

    heap = [0] * bins
    for s in sorted(sizes, reverse=True):
        heapq.heapreplace(heap, heap[0] + s)
    return max(heap)


def load_bytes_report(head: bytes, sections: bytes, model: str, layout: sm.Layout, sample: int,
                      ranks_per_node: int) -> Dict[str, Any]:
    """Bytes leaving storage for one same-layout load, per mode: the job's total and the busiest
    node's, against the unique bytes (every saved byte: a same-layout resume needs all of them).
    ``own``: every rank its ranges (each DP replica reads again); ``scatter``: each node the union
    of its ranks' ranges; ``readonce``: the unique bytes once, whole files spread over the nodes
    largest first (the file-system plan; on S3 extents are balanced, so its busiest node is at most
    this). From the same load plans as the ranks run; sampled nodes: totals are the mean times the
    nodes, marked ``est`` unless every node is sampled."""
    index = mf.LazyIndex(mf.parse_head(head, "simulated"), lambda s, n: sections[s:s + n], "simulated", len(head))
    files = [int(info.get("bytes", 0)) for info in index.files.values()]
    unique = sum(files)
    world = layout.world
    nodes = -(-world // ranks_per_node)
    own, scatter = [], []
    for nd in _sample(nodes, sample):
        members = range(nd * ranks_per_node, min(world, (nd + 1) * ranks_per_node))
        own.append(sum(n for r in members
                       for _f, _o, n in plan_rank(head, sections, model, layout, r, ranges=True)["ranges"]))
        scatter.append(_union_bytes([x for r in members for x in
                                     plan_rank(head, sections, model, layout, r, rows_ok=False, ranges=True)["ranges"]]))
    exact = len(own) >= nodes

    def mode(per_node: Sequence[int]) -> Dict[str, Any]:
        total = sum(per_node) if exact else round(sum(per_node) / len(per_node) * nodes)
        return {"total_bytes": total if exact else f"{total} (est)", "max_node_bytes": max(per_node),
                "vs_unique": round(total / max(unique, 1), 3)}

    return {"load_unique_bytes": unique, "load_nodes": nodes, "load_ranks_per_node": ranks_per_node,
            "load_storage_bytes": {
                "own": mode(own), "scatter": mode(scatter),
                "readonce": {"total_bytes": unique, "max_node_bytes": _largest_first(files, nodes),
                             "vs_unique": 1.0}}}


def _sample(world: int, n: int) -> List[int]:
    if world <= n:
        return list(range(world))
    step = world / n
    return sorted({int(i * step) for i in range(n)} | {world - 1})


def run(model: str, layout: sm.Layout, reshard: Optional[sm.Layout], sample: int, storage: str = "posix",
        ranks_per_node: int = 8, group: Optional[int] = None, load_bytes: bool = False) -> Dict[str, Any]:
    out = simulate_save(model, layout, group=group)
    head, sections = out.pop("_head"), out.pop("_sections")
    ranks = [plan_rank(head, sections, model, layout, r) for r in _sample(layout.world, sample)]
    out["rank_plan_s"] = round(max(r["plan_s"] for r in ranks), 3)
    out["rank_index_read_bytes"] = max(r["index_read_bytes"] for r in ranks)
    out["same_layout_read_amplification"] = round(max(r["read_bytes"] / max(r["needed_bytes"], 1) for r in ranks), 3)
    out["problems"] = [p for r in ranks for p in r["problems"]][:5]
    if reshard is not None:
        rs = [plan_rank(head, sections, model, reshard, r) for r in _sample(reshard.world, sample)]
        out["reshard_to"] = f"TP{reshard.tp}·PP{reshard.pp}·DP{reshard.dp}" + (f"·EP{reshard.ep}" if reshard.ep > 1 else "")
        out["reshard_read_amplification"] = round(max(r["read_bytes"] / max(r["needed_bytes"], 1) for r in rs), 3)
        out["reshard_temp_bytes"] = max(r["temp_bytes"] for r in rs)
        out["reshard_rank_plan_s"] = round(max(r["plan_s"] for r in rs), 3)
        out["reshard_problems"] = [p for r in rs for p in r["problems"]][:5]
    if storage == "s3":
        out.update(s3_report(head, sections, model, layout, sample, ranks_per_node))
    if load_bytes:
        out.update(load_bytes_report(head, sections, model, layout, sample, ranks_per_node))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(sm.MODELS), required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--vp", type=int, default=None)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--reshard-to", default=None, help="TP,PP,DP[,EP] of the loading job")
    ap.add_argument("--sample", type=int, default=16, help="ranks whose load plan is measured")
    ap.add_argument("--storage", choices=("posix", "s3"), default="posix",
                    help="s3: also the object-store request counts of a save and of loads")
    ap.add_argument("--ranks-per-node", type=int, default=8,
                    help="ranks per node for scatter loads (--storage s3) and --load-bytes")
    ap.add_argument("--load-bytes", action="store_true",
                    help="bytes leaving storage per load and per node, own / scatter / readonce")
    ap.add_argument("--gather-group", type=int, default=None,
                    help="ranks per group of the two-level gather (default: as megashard.transport; 0: one flat gather)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    layout = sm.Layout(tp=a.tp, pp=a.pp, dp=a.dp, ep=a.ep, vp=a.vp, distributed_optimizer=a.distributed_optimizer)
    reshard = None
    if a.reshard_to:
        v = [int(x) for x in a.reshard_to.split(",")]
        reshard = sm.Layout(tp=v[0], pp=v[1], dp=v[2], ep=v[3] if len(v) > 3 else 1, vp=a.vp,
                            distributed_optimizer=a.distributed_optimizer)
    out = {"model": a.model, "layout": f"TP{a.tp}·PP{a.pp}·DP{a.dp}" + (f"·EP{a.ep}" if a.ep > 1 else "")}
    group = None if a.gather_group is None else (a.gather_group or layout.world)
    out.update(run(a.model, layout, reshard, a.sample, a.storage, a.ranks_per_node, group, a.load_bytes))
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>34}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
