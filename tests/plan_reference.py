"""main's ``plan.coordinate_save`` before the two-level plan (commit 6540075), kept as the oracle
the grouped plan must reproduce reply for reply (tests/test_plan_groups.py)."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from megashard.plan import SaveAssignment, Shape, _keys_tiling_exactly, _split_flat, assign_writers, chunk_coverage_problems


def reference_coordinate_save(messages: Sequence[Mapping[str, Any]]) -> SaveAssignment:
    """Validate every rank's announcement (one dtype and global shape per key, every
    tensor covered exactly once, one main replica per object) and choose one writer per
    distinct shard, object and state-tree blob. Work is per *distinct* announcement text
    plus one step per rank: 16,384 data-parallel replicas of the same shards cost little
    more than one. Raises ``ValueError`` with every problem found."""


    problems: List[str] = []
    by_fixed: Dict[str, List[int]] = {}
    by_flat: Dict[str, List[int]] = {}
    for rank, m in enumerate(messages):
        by_fixed.setdefault(m["fixed"], []).append(rank)
        by_flat.setdefault(m["flat"], []).append(rank)
    # every distinct shard gets an integer id; holders are kept as the rank lists of the
    # announcement texts that name it (one list object per text, shared, never copied)
    parsed: Dict[str, List[int]] = {}  # announcement text -> shard ids in order
    # shard -> its id, by (chunk id, flat start, flat stop), or (chunk id, None) for a whole chunk: a
    # tuple of small ints hashes in a few steps (keys with offset and shape tuples, a million of them
    # at 131,072 ranks, were rehashed at every lookup)
    ids: Dict[Tuple, int] = {}
    chunk_list: List[Tuple[str, Shape, Shape]] = []  # chunk id -> (key, offset, shape)
    nbytes: List[int] = []
    held_by: List[List[List[int]]] = []
    kinds: Dict[str, Tuple[str, List[int]]] = {}  # key -> (dtype, global shape) as first announced
    # the coverage check's input as flat integer lists (numpy arrays later, no object per piece):
    # per distinct chunk its key's position in ``kinds``, rank, offset and shape; per shard its
    # chunk and flat range (-1: the whole chunk)
    key_no: Dict[str, int] = {}
    chunk_of: Dict[Tuple, int] = {}
    c_key: List[int] = []
    c_nd: List[int] = []
    c_dims: List[int] = []  # offset then shape of each chunk, concatenated
    p_chunk: List[int] = []
    p_flat: List[int] = []  # start, stop of each shard

    def entry(key: str, dt: str, gshape: List[int], off: List[int], cshape: List[int]) -> Tuple[Any, ...]:
        """(key, offset, chunk shape, chunk id, problem) of one announced chunk; a problem is the
        text before and after the rank to name."""
        ck = (key, tuple(off), tuple(cshape))
        problem = None
        known = kinds.get(key)
        if known is None:
            kinds[key] = (dt, gshape)
            key_no[key] = len(key_no)
        elif known[0] != dt or known[1] != gshape:
            problem = (f"tensor {key!r}: rank ", f" has dtype {dt} global shape {tuple(gshape)}, another rank has "
                       f"{known[0]} {tuple(known[1])}")
        c = chunk_of.get(ck)
        if c is None:
            c = chunk_of[ck] = len(c_key)
            chunk_list.append(ck)
            c_key.append(key_no[key])
            c_nd.append(len(off))
            c_dims.extend(off)
            c_dims.extend(cshape)
        return ck + (c, problem)

    templates: Dict[str, List[Tuple[Any, ...]]] = {}  # chunk list of "flat" texts -> entry() of each
    for text, ranks in by_fixed.items():
        got = parsed[text] = []
        for key, dt, gshape, off, cshape, fl, nb in json.loads(text):
            key, o, cs, c, problem = entry(key, dt, gshape, off, cshape)
            if problem:
                problems.append(f"{problem[0]}{ranks[0]}{problem[1]}")
            sid = (c, *fl) if fl else (c, None)
            i = ids.get(sid)
            if i is None:
                i = ids[sid] = len(nbytes)
                nbytes.append(nb)
                held_by.append([])
                p_chunk.append(c)
                a, b = fl if fl else (0, -1)
                p_flat += (a, b if b != -1 or not fl else -2)
            got.append(i)
        for i in got:
            held_by[i].append(ranks)
    for text, ranks in by_flat.items():
        ints, chunks = _split_flat(text)
        tmpl = templates.get(chunks)
        if tmpl is None:
            tmpl = templates[chunks] = [entry(*e) for e in json.loads(chunks)]
        ints = json.loads(ints)
        if len(ints) != 3 * len(tmpl):
            raise ValueError(f"malformed announcement of flattened shards from rank {ranks[0]}")
        got = parsed[text] = []
        for j, (key, o, cs, c, problem) in enumerate(tmpl):
            if problem:
                problems.append(f"{problem[0]}{ranks[0]}{problem[1]}")
            a, b = ints[3 * j], ints[3 * j + 1]
            sid = (c, a, b)
            i = ids.get(sid)
            if i is None:
                i = ids[sid] = len(nbytes)
                nbytes.append(ints[3 * j + 2])
                held_by.append([])
                p_chunk.append(c)
                p_flat += (a, b if b != -1 else -2)  # -1 stands for "the whole chunk" (fixed shards)
            got.append(i)
        for i in got:
            held_by[i].append(ranks)
    templates.clear()  # what is dead is dropped as soon as it is (the plan's peak memory, issue 32)
    tensors = {k: (dt, tuple(gs)) for k, (dt, gs) in kinds.items()}
    holders: Dict[int, Sequence[int]] = {}
    merged: Dict[Tuple[int, ...], List[int]] = {}  # one list per combination of texts (shared heaps)
    writer = [-1] * len(nbytes)
    load: Dict[int, int] = {}  # bytes of the shards only one rank holds (each its own writer), by rank
    for i, lists in enumerate(held_by):
        if len(lists) == 1:
            if len(lists[0]) == 1:  # a distributed-optimizer piece: no choice to make
                r = writer[i] = lists[0][0]
                load[r] = load.get(r, 0) + nbytes[i]
            else:
                holders[i] = lists[0]
            continue
        combo = tuple(map(id, lists))  # the lists live in by_fixed/by_flat: ids are stable
        got = merged.get(combo)
        if got is None:
            got = merged[combo] = [r for lst in lists for r in lst]
        holders[i] = got
    del held_by, merged
    preferred: Dict[int, int] = {}
    for rank, m in enumerate(messages):
        if m["main"]:
            fixed, flat = parsed[m["fixed"]], parsed[m["flat"]]
            for j in m["main"]:
                preferred.setdefault(fixed[j] if j < len(fixed) else flat[j - len(fixed)], rank)
    chunk_of.clear()
    exact = _keys_tiling_exactly([tensors[k][1] for k in kinds], c_key, c_nd, c_dims, p_chunk, p_flat)
    for lst in (c_key, c_nd, c_dims, p_chunk, p_flat):
        lst.clear()
    if not all(exact):  # the detailed check names the problems of the other keys, piece by piece
        doubt = {k for k, ok in zip(kinds, exact) if not ok}
        by_key: Dict[str, List[Tuple[Shape, Shape, Optional[Tuple[int, int]]]]] = {k: [] for k in doubt}
        for sid in ids:
            key, o, cs = chunk_list[sid[0]]
            if key in doubt:
                by_key[key].append((o, cs, None if sid[1:] == (None,) else tuple(sid[1:])))
        for key, pieces in by_key.items():
            problems += chunk_coverage_problems(key, tensors[key][1], pieces)
    ids.clear()  # the shard ids' tuples: not needed any more (the plan's peak memory, issue 32)
    for i, w in assign_writers(holders, nbytes, preferred, load).items():
        writer[i] = w
    del holders, nbytes, preferred, load
    # objects: the main replica writes; without one, the first holder
    obj_parsed: Dict[str, List[str]] = {}
    obj_ranks: Dict[str, List[int]] = {}
    obj_writer: Dict[str, int] = {}
    for rank, m in enumerate(messages):
        ukeys = obj_parsed.get(m["objects"])
        if ukeys is None:
            ukeys = obj_parsed[m["objects"]] = json.loads(m["objects"])
        obj_ranks.setdefault(m["objects"], []).append(rank)
        for i in m["objects_main"]:
            u = ukeys[i]
            if u in obj_writer:
                problems.append(f"object {u!r}: main replica on ranks {obj_writer[u]} and {rank}")
            obj_writer[u] = rank
    # each rank's list differs (a few objects are its own) but names mostly the same objects: a million
    # names at 16,384 ranks, tens of objects each, for tens of thousands of objects. The lists are
    # walked name by name only when some object has no main replica
    written = obj_writer.keys()
    if not all(written >= set(ukeys) for ukeys in obj_parsed.values()):  # no set of every name (memory)
        for text, ukeys in obj_parsed.items():  # objects without a main replica: the first rank holding one
            for u in ukeys:
                obj_writer.setdefault(u, obj_ranks[text][0])
    if problems:
        head = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise ValueError(f"sharded state dict is inconsistent across ranks:\n  {head}{more}")
    # each rank's reply, computed per distinct announcement text (not per rank and record)
    world = len(messages)
    writes: List[List[int]] = [[] for _ in range(world)]
    nfixed = [len(parsed[m["fixed"]]) for m in messages]
    for groups, flat_part in ((by_fixed, False), (by_flat, True)):
        for text, ranks in groups.items():
            rset = set(ranks)
            for j, sid in enumerate(parsed[text]):
                w = writer[sid]
                if w in rset:
                    writes[w].append(nfixed[w] + j if flat_part else j)
    obj_writes: List[List[int]] = [[] for _ in range(world)]  # per object its writer's entries naming it
    for u, w in obj_writer.items():
        ukeys = obj_parsed[messages[w]["objects"]]
        got = obj_writes[w]
        i = ukeys.index(u)
        while i >= 0:
            got.append(i)
            try:
                i = ukeys.index(u, i + 1)  # listed twice (the rank sends the object once)
            except ValueError:
                i = -1
    for got in obj_writes:
        if len(got) > 1:
            got.sort()
    # state-tree blobs: the first rank holding one uploads it; every rank also learns the
    # uploader of each of its blobs, and the uploader how many entries share it, which is what
    # lets a later save with the same plan check in one all-reduce that the blobs still group
    # the same way (megashard.saving.plan_vote)
    # (data-parallel replicas in one gather group share one decoded list: each list is read once)
    blob_owner: Dict[str, int] = {}
    blob_count: Dict[str, int] = {}
    times: Dict[int, List[Any]] = {}  # id of a rank's blob list -> [the list, ranks sending it]
    for rank, m in enumerate(messages):
        got = times.get(id(m["blobs"]))
        if got is not None:  # an earlier rank holds these blobs: none is this rank's to upload
            got[1] += 1
            continue
        times[id(m["blobs"])] = [m["blobs"], 1]
        for _key, sha, *_ in m["blobs"]:
            blob_owner.setdefault(sha, rank)
    for blobs, n in times.values():
        for _key, sha, *_ in blobs:
            blob_count[sha] = blob_count.get(sha, 0) + n
    owners: Dict[int, List[int]] = {}
    replies: List[Dict[str, Any]] = []
    for rank, m in enumerate(messages):
        upload: List[str] = []
        lead: List[List[int]] = []  # [entry index, entries sharing it] of the blobs this rank uploads
        own = owners.get(id(m["blobs"]))
        if own is None:
            own = owners[id(m["blobs"])] = [blob_owner[sha] for _key, sha, *_ in m["blobs"]]
            for j, (_key, sha, *_) in enumerate(m["blobs"]):
                if own[j] == rank and sha not in upload:
                    upload.append(sha)
                    lead.append([j, blob_count[sha]])
        writes[rank].sort()  # in place, and the ranks sending the same blobs share one owner list:
        # 131,072 replies are held at once (nothing changes a reply before it is encoded)
        replies.append({"write": writes[rank], "objects": obj_writes[rank], "blobs": upload,
                        "blob_owners": own, "blob_lead": lead})
    return SaveAssignment(replies, tensors, blob_owner)


