"""megashard checkpoint -> Hugging Face Llama / Mixtral directory, streamed layer by layer.

:func:`plan_export` checks everything before anything is written (the saved ``args``
against the mapping, every tensor's global shape, the vocabulary); :func:`write_export`
then reads one layer at a time through the slice planner (only that layer's boxes of the
stacked global tensors, only the real vocabulary rows), transforms it, and writes it to
``model-0000k-of-0000n.safetensors`` shards (or one ``model.tensors`` file), while the
next layer is read in the background (an MoE layer: its attention and router, then one
expert at a time). Memory: about two layers (experts) plus one write buffer;
the whole model is never held, and no stacked global tensor is ever assembled.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..consolidated import read_boxes
from ..errors import CheckpointError
from ..loading import load_common
from ..manifest import Manifest, itemsize
from ..plan import numel
from ..storage import checkpoint_location, read_manifest
from . import mapping as M
from .mapping import HFMappingError, LlamaSpec
from .safetensors import SafetensorsWriter

log = logging.getLogger(__name__)

__all__ = ["ExportPlan", "plan_export", "write_export", "tokenizer_vocab_size", "saved_vocab_size",
           "TOKENIZER_FILES", "DEFAULT_SHARD_BYTES", "TENSORS_FILE"]

DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
TENSORS_FILE = "model.tensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
MAX_TOKENIZER_JSON = 256 << 20

Box = Tuple[str, Tuple[int, ...], Tuple[int, ...]]


@dataclass
class Step:
    """Boxes to read, and what to make of them: HF tensors in ``outs`` order."""

    reads: List[Box]
    outs: List[Tuple[str, Tuple[int, ...]]]
    make: Callable[[List[torch.Tensor]], List[torch.Tensor]]


@dataclass
class ExportPlan:
    src: str
    manifest: Manifest
    spec: LlamaSpec
    steps: List[Step]
    tokenizer: Optional[str] = None
    tokenizer_files: List[str] = field(default_factory=list)

    @property
    def outs(self) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
        return [(n, self.spec.dtype, s) for st in self.steps for n, s in st.outs]

    @property
    def nbytes(self) -> int:
        return sum(numel(s) * itemsize(d) for _, d, s in self.outs)


def tokenizer_vocab_size(directory: str) -> Tuple[int, List[str]]:
    """(vocabulary size, tokenizer files present) of a tokenizer directory.

    The size is read from ``tokenizer.json`` (the largest id of its vocabulary and added
    tokens, plus one); other tokenizers need ``--vocab-size``.
    """
    d = os.path.abspath(directory)
    if not os.path.isdir(d):
        raise HFMappingError(f"{d}: --tokenizer must be a directory of tokenizer files")
    files = []
    for name in TOKENIZER_FILES:
        p = os.path.join(d, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise HFMappingError(f"{p}: not a regular file (symbolic links are refused); copy the tokenizer "
                                 "with real files")
        files.append(name)
    if "tokenizer.json" not in files:
        raise HFMappingError(f"{d}: no tokenizer.json to read the vocabulary size from; pass --vocab-size N")
    p = os.path.join(d, "tokenizer.json")
    if os.lstat(p).st_size > MAX_TOKENIZER_JSON:
        raise HFMappingError(f"{p}: larger than {MAX_TOKENIZER_JSON} bytes; pass --vocab-size N")
    with open(p, "rb") as f:
        try:
            doc = json.loads(f.read())
        except ValueError as e:
            raise HFMappingError(f"{p}: not JSON ({e}); pass --vocab-size N") from None
    ids: List[int] = []
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):
        ids.append(len(vocab) - 1)
    for t in (doc.get("added_tokens") or []) if isinstance(doc, dict) else []:
        if isinstance(t, dict) and isinstance(t.get("id"), int):
            ids.append(t["id"])
    if not ids or min(ids) < 0:
        raise HFMappingError(f"{p}: no vocabulary found; pass --vocab-size N")
    return max(ids) + 1, files


def saved_vocab_size(args: Any) -> Optional[int]:
    """The vocabulary a Megatron checkpoint was trained with, when its args hold it (``--vocab-size``,
    which Megatron-LM's NullTokenizer and an import from Hugging Face set; other tokenizers only record
    the padded size)."""
    v = getattr(args, "vocab_size", None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _moe_layer_steps(s: LlamaSpec, i: int, keys: Dict[str, str]) -> List[Step]:
    """MoE layer ``i``: attention, norms and router in one step, then one step per expert."""
    per = M.megatron_layer_shapes(s)
    order = [M.NORM_IN[0], M.QKV_W, M.PROJ_W, M.NORM_POST[0], M.ROUTER_W]
    reads: List[Box] = [(keys[k], (i,) + (0,) * len(per[k]), (1, *per[k])) for k in order]

    def make(got: List[torch.Tensor]) -> List[torch.Tensor]:
        norm_in, qkv, proj, norm_post, router = (g[0] for g in got)
        return [norm_in, *M.qkv_to_hf(qkv, s), proj, norm_post, router]

    names = M.layer_hf_names(i, s)
    steps = [Step(reads, names[:len(order) + 2], make)]
    f, h = s.ffn, s.hidden
    for e in range(s.experts):
        def expert(got: List[torch.Tensor]) -> List[torch.Tensor]:
            fc1, fc2 = got[0][0, 0], got[1][0, 0]
            return [fc1[:f], fc2, fc1[f:]]  # w1 (gate), w2 (down), w3 (up)

        steps.append(Step([(keys[M.EXP_FC1], (i, e, 0, 0), (1, 1, 2 * f, h)),
                           (keys[M.EXP_FC2], (i, e, 0, 0), (1, 1, h, f))], M.expert_hf_names(i, e, s), expert))
    return steps


def _layer_step(m: Manifest, s: LlamaSpec, i: int, keys: Dict[str, str], fc1_split: bool) -> Step:
    """Layer ``i``: read its row of every stacked tensor, produce its HF tensors."""
    per = M.megatron_layer_shapes(s)
    order = [M.NORM_IN[0], M.QKV_W, M.PROJ_W, M.NORM_POST[0], M.FC1_W, M.FC2_W]
    if s.bias:
        order += [M.QKV_B, M.PROJ_B, M.FC1_B, M.FC2_B]
    reads: List[Box] = []
    for k in order:
        if k == M.FC1_W and fc1_split:  # singleton_local_shards: gate and up saved as two keys
            half = (s.ffn, s.hidden)
            reads += [(keys[k] + "_w", (i, 0, 0), (1, *half)), (keys[k] + "_v", (i, 0, 0), (1, *half))]
            continue
        shape = per[k]
        reads.append((keys[k], (i,) + (0,) * len(shape), (1, *shape)))

    def make(got: List[torch.Tensor]) -> List[torch.Tensor]:
        t = [g[0] for g in got]
        if fc1_split:
            norm_in, qkv, proj, norm_post, gate, up, fc2, *b = t
        else:
            norm_in, qkv, proj, norm_post, fc1, fc2, *b = t
            gate, up = fc1[:s.ffn], fc1[s.ffn:]
        q, k, v = M.qkv_to_hf(qkv, s)
        out = [norm_in, q]
        if s.bias:
            qb, kb, vb = M.qkv_to_hf(b[0], s)
            out += [qb, k, kb, v, vb, proj, b[1], norm_post, gate, b[2][:s.ffn], up, b[2][s.ffn:], fc2, b[3]]
        else:
            out += [k, v, proj, norm_post, gate, up, fc2]
        return out

    return Step(reads, M.layer_hf_names(i, s), make)


def plan_export(src: str, vocab_size: Optional[int] = None, tokenizer: Optional[str] = None) -> ExportPlan:
    """Check the checkpoint against the Llama / Mixtral mapping; nothing is read but the index and ``args``."""
    base = checkpoint_location(src)
    m = read_manifest(base)
    args = load_common(base, ["args"]).get("args")
    emb = m.tensors.get(M.EMBED)
    if emb is None:
        raise HFMappingError(f"{base}: no {M.EMBED!r}: not a Megatron GPT checkpoint")
    padded = int(emb.global_shape[0])
    saved = saved_vocab_size(args)
    files: List[str] = []
    given = "--vocab-size"
    if tokenizer is not None:
        tok_vocab, files = tokenizer_vocab_size(tokenizer)
        if vocab_size is not None and vocab_size != tok_vocab:
            raise HFMappingError(f"--vocab-size {vocab_size} disagrees with {tokenizer}'s {tok_vocab} tokens")
        vocab_size, given = tok_vocab, "the tokenizer"
    if vocab_size is None and saved is not None:
        # Megatron-LM's NullTokenizer has one more token, its eod (id vocab_size), with megatron-core 0.16
        # (not with 0.19): export that row too, as it may be trained
        null = getattr(args, "tokenizer_type", None) == "NullTokenizer" and saved < padded
        vocab_size = saved + 1 if null else saved
    if vocab_size is None:
        raise HFMappingError(f"{base}: the checkpoint's vocabulary is padded and its real size is not saved; pass "
                             "--vocab-size N or --tokenizer DIR (whose files are copied into the export)")
    if vocab_size <= 0:
        raise HFMappingError(f"--vocab-size {vocab_size}: must be positive")
    if saved is not None and vocab_size < saved:
        what = f"--vocab-size {vocab_size} is smaller" if given == "--vocab-size" else \
            f"the tokenizer's {vocab_size} tokens are fewer"
        raise HFMappingError(f"{what} than the vocabulary the checkpoint was trained with ({saved}, its saved args' "
                             f"vocab_size): the export would drop embedding rows {vocab_size}..{saved - 1}; nothing "
                             "was written (leave out --vocab-size and --tokenizer to export the saved size)")
    if saved is not None and saved < vocab_size <= padded:
        log.warning("%s: exporting %d vocabulary rows; the checkpoint was trained with %d (its saved args' "
                    "vocab_size): rows %d..%d are padding", base, vocab_size, saved, saved, vocab_size - 1)
    dtype = emb.dtype
    s = M.spec_from_megatron_args(args, vocab_size, padded, dtype, base)
    # the norms' saved names depend on the layer spec (fused TE names, or the local spec's mapped ones)
    keys = {k: M.LAYER + k for k in M.megatron_layer_shapes(s)}
    for canon, alias in (M.NORM_IN, M.NORM_POST):
        if M.LAYER + canon not in m.tensors and M.LAYER + alias in m.tensors:
            keys[canon] = M.LAYER + alias
    fc1_split = M.LAYER + M.FC1_W not in m.tensors and M.LAYER + M.FC1_W + "_w" in m.tensors
    found = {k: tuple(r.global_shape) for k, r in m.tensors.items()}
    for canon, key in keys.items():
        if key != M.LAYER + canon and key in found:
            found[M.LAYER + canon] = found[key]
    if fc1_split:
        w, v = found.get(M.LAYER + M.FC1_W + "_w"), found.get(M.LAYER + M.FC1_W + "_v")
        if w is None or v is None or w != v:
            raise HFMappingError(f"{base}: SwiGLU halves {M.FC1_W}_w / _v disagree: {w} vs {v}")
        found[M.LAYER + M.FC1_W] = (w[0], 2 * w[1], *w[2:])
    M.check_shapes(found, s, padded, base)
    for k in found:
        rec = m.tensors.get(k)
        if rec is not None and not k.startswith("optimizer.") and rec.dtype != dtype:
            raise HFMappingError(f"{base}: {k!r} is {rec.dtype}, the embedding {dtype}: mixed model dtypes are "
                                 "not exported")
    known = set(M.dense_model_keys(s)) | set(keys.values()) | {M.OUTPUT}
    if fc1_split:
        known |= {M.LAYER + M.FC1_W + "_w", M.LAYER + M.FC1_W + "_v"}
    unknown = [k for k in m.tensors if k not in known and not k.startswith("optimizer.")
               and not k.endswith("._extra_state") and "rotary_pos_emb" not in k]
    if unknown:
        raise HFMappingError(f"{base}: model tensors the Llama / Mixtral mapping does not cover: "
                             f"{', '.join(unknown[:8])}; nothing was written")
    h = s.hidden
    steps = [Step([(M.EMBED, (0, 0), (s.vocab, h))], [("model.embed_tokens.weight", (s.vocab, h))], lambda g: g)]
    for i in range(s.num_layers):
        steps += _moe_layer_steps(s, i, keys) if s.moe else [_layer_step(m, s, i, keys, fc1_split)]
    tail: List[Box] = [(M.FINAL_NORM, (0,), (h,))]
    outs = [("model.norm.weight", (h,))]
    if not s.tied:
        tail.append((M.OUTPUT, (0, 0), (s.vocab, h)))
        outs.append(("lm_head.weight", (s.vocab, h)))
    steps.append(Step(tail, outs, lambda g: g))
    return ExportPlan(base, m, s, steps, os.path.abspath(tokenizer) if tokenizer else None, files)


def _steps(plan: ExportPlan, threads: Optional[int]) -> Any:
    """Yield (HF name, tensor), reading the next step while the caller writes this one."""
    def read(st: Step) -> List[torch.Tensor]:
        got, _ = read_boxes(plan.src, plan.manifest, [(k, o, sh, None) for k, o, sh in st.reads], threads=threads)
        return got

    with ThreadPoolExecutor(1, thread_name_prefix="megashard-hf-read") as pool:
        pending = pool.submit(read, plan.steps[0])
        for i, st in enumerate(plan.steps):
            got = pending.result()
            pending = pool.submit(read, plan.steps[i + 1]) if i + 1 < len(plan.steps) else None
            made = st.make(got)
            del got
            for (name, shape), t in zip(st.outs, made):
                if tuple(t.shape) != tuple(shape):
                    raise CheckpointError(f"{plan.src}: {name}: made {tuple(t.shape)}, planned {tuple(shape)}")
                yield name, t
            del made


def _shards(outs: Sequence[Tuple[str, torch.dtype, Tuple[int, ...]]], shard_bytes: int) -> List[List[int]]:
    """Consecutive tensors grouped into files of at most ``shard_bytes`` (a larger tensor alone)."""
    groups: List[List[int]] = []
    size = 0
    for i, (_, d, s) in enumerate(outs):
        n = numel(s) * itemsize(d)
        if not groups or (groups[-1] and size + n > shard_bytes):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def write_export(plan: ExportPlan, target: str, *, tensors_file: bool = False,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, threads: Optional[int] = None,
                 progress: Optional[Callable[[int], None]] = None) -> Tuple[int, int]:
    """Write the HF directory ``target`` (created here; the caller renames it into place).

    Returns (tensors, bytes) written.
    """
    os.makedirs(target)
    outs = plan.outs
    written = 0
    if tensors_file:
        from ..format.stream import StreamWriter

        writers: List[Any] = [StreamWriter(os.path.join(target, TENSORS_FILE), outs)]
        where = [0] * len(outs)
    else:
        groups = _shards(outs, shard_bytes)
        names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
        writers = []
        where = [0] * len(outs)
        for k, g in enumerate(groups):
            for i in g:
                where[i] = k
        weight_map = {outs[i][0]: names[where[i]] for i in range(len(outs))}
    cur = -1
    try:
        for i, (name, t) in enumerate(_steps(plan, threads)):
            if not tensors_file and where[i] != cur:
                if writers:
                    writers[-1].close()
                cur = where[i]
                writers.append(SafetensorsWriter(os.path.join(target, names[cur]), [outs[j] for j in groups[cur]],
                                                 {"format": "pt"}))
            writers[-1].write(name, t)
            n = t.numel() * t.element_size()
            written += n
            if progress is not None:
                progress(n)
            del t
        writers[-1].close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    if not tensors_file:
        index = {"metadata": {"total_size": plan.nbytes}, "weight_map": weight_map}
        with open(os.path.join(target, "model.safetensors.index.json"), "x") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(target, "config.json"), "x") as f:
        json.dump(plan.spec.hf_config(), f, indent=2)
    for name in plan.tokenizer_files:
        assert plan.tokenizer is not None
        src = os.path.join(plan.tokenizer, name)
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fin, open(os.path.join(target, name), "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    for name in os.listdir(target):
        fd = os.open(os.path.join(target, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return len(outs), written
