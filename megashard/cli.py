"""The ``megashard`` command line: inspect and verify `.tensors` files and checkpoints.

    megashard inspect PATH [--json] [--long]  # a file: version + tensors; a checkpoint: its summary
    megashard verify PATH [--json]    # every hash; exit 0 only when all match, else 1
    megashard recover PATH            # restore an interrupted re-save, remove dead saves' temporaries
    (PATH may be a Megatron save root: its iterations are listed, its tracker's checkpoint is read)
    megashard convert SRC DST [--to megashard|torch_dist|tensors|safetensors|hf] [--keys PATTERN ...]
                      [--iteration N]  # one process; see megashard.convert
    megashard convert SRC DST --to hf [--vocab-size N | --tokenizer DIR] [--tensors]  # a Hugging Face directory
    megashard convert HF_DIR DST [--to megashard]  # import: DST/release + tracker, for --load DST
    megashard copy SRC DST [--iteration N | --all] [--sha256]  # directory <-> s3://, checked; see megashard.copy

A directory argument is handed to :mod:`megashard.checkpoint_tools` (imported
lazily, so file commands work without the checkpoint layer). Exit codes: 0 ok,
1 verification failure or unreadable input, 2 usage error (for ``convert``: SRC is
not a checkpoint, unknown format, DST exists; for ``copy``: SRC is neither a checkpoint
nor a save root, or the options do not fit it; DST is then untouched).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Sequence, TextIO

from . import saveroot, storage
from .errors import MegashardError


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _human_bytes(n: int) -> str:
    step = 1024.0
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < step or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= step
    return f"{n} B"


def _file_summary(path: str) -> dict[str, Any]:
    from .format import open_file

    with open_file(path) as r:
        infos = r.infos()
        return {
            "path": path,
            "kind": "file",
            "data_version": r.version,
            "file_size": r.file_size,
            "tensor_count": len(infos),
            "data_bytes": sum(i.nbytes for i in infos),
            "tensors": [
                {
                    "name": i.name,
                    "dtype": _dtype_name(i.dtype),
                    "shape": list(i.shape),
                    "nbytes": i.nbytes,
                    "data_offset": i.data_offset,
                    "header_offset": i.header_offset,
                    "crc32": f"{i.crc32:08x}",
                    "sha256": i.sha256 or None,  # None: a CRC32-only header (saved with sha256=False)
                    "tensor_type": i.tensor_type,
                    "is_meta": i.is_meta,
                }
                for i in infos
            ],
        }


def _print_file_summary(s: dict[str, Any], out: TextIO) -> None:
    print(f"file:         {s['path']}", file=out)
    print(f"data version: {s['data_version']}", file=out)
    print(f"file size:    {s['file_size']} bytes ({_human_bytes(s['file_size'])})", file=out)
    print(f"tensors:      {s['tensor_count']}, {s['data_bytes']} data bytes "
          f"({_human_bytes(s['data_bytes'])})", file=out)
    rows = [("name", "dtype", "shape", "bytes", "offset")]
    for t in s["tensors"]:
        shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
        dtype = t["dtype"] + (" (meta)" if t["is_meta"] else "")
        rows.append((t["name"], dtype, shape, str(t["nbytes"]), str(t["data_offset"])))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) if c < 3 else r[c].rjust(widths[c]) for c in range(5)).rstrip(),
              file=out)


def _print_nested(value: Any, out: TextIO, indent: int = 0) -> None:
    """Readable dump of the checkpoint summary dict (whatever its shape)."""
    pad = "  " * indent
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                print(f"{pad}{k}:", file=out)
                _print_nested(v, out, indent + 1)
            else:
                print(f"{pad}{k}: {v}", file=out)
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, dict):
                print(f"{pad}-", file=out)
                _print_nested(v, out, indent + 1)
            else:
                print(f"{pad}- {v}", file=out)
    else:
        print(f"{pad}{value}", file=out)


def _args_lines(a: dict[str, Any]) -> list[str]:
    """The saved args' model and parallel sizes, one line each (what a user compares first)."""
    model = []
    if "padded_vocab_size" in a:
        real = f" from {a['vocab_size']}" if "vocab_size" in a else ""
        model.append(f"vocabulary {a['padded_vocab_size']} (padded{real})")
    elif "vocab_size" in a:
        model.append(f"vocabulary {a['vocab_size']}")
    for key, label in (("hidden_size", "hidden"), ("num_layers", "layers"), ("num_attention_heads", "heads"),
                       ("num_query_groups", "query groups"), ("ffn_hidden_size", "ffn"), ("seq_length", "sequence"),
                       ("num_experts", "experts")):
        if key in a:
            model.append(f"{label} {a[key]}")
    parallel = [f"{label} {a[key]}" for key, label in (
        ("tensor_model_parallel_size", "TP"), ("pipeline_model_parallel_size", "PP"),
        ("virtual_pipeline_model_parallel_size", "VP"), ("expert_model_parallel_size", "EP"),
        ("context_parallel_size", "CP"), ("data_parallel_size", "DP")) if key in a]
    world = f" (world {a['world_size']})" if "world_size" in a else ""
    return ([f"model:        {', '.join(model)}"] if model else []) + (
        [f"parallel:     {', '.join(parallel)}{world}"] if parallel else [])


def _print_checkpoint_summary(s: dict[str, Any], out: TextIO, long: bool = False) -> None:
    """Totals (size, files, tensors, layout, iteration, saved args, contents); with ``long``, every
    file and global tensor."""
    t = s.get("totals")
    if not isinstance(t, dict):
        _print_nested(s, out)
        return
    print(f"checkpoint:   {s.get('path')}", file=out)
    print(f"size:         {t['bytes']} bytes ({_human_bytes(t['bytes'])}) in {t['files']} files", file=out)
    print(f"tensors:      {t['global_tensors']} global tensors in {t['shards']} shards", file=out)
    print(f"layout:       {t['layout']} (saved by {t['world_size']} ranks)", file=out)
    print(f"iteration:    {t['iteration'] if t['iteration'] is not None else 'unknown'}", file=out)
    for line in _args_lines(t.get("saved_args") or {}):
        print(line, file=out)
    print("holds:", file=out)
    holds = t["holds"]
    for what in ("model", "optimizer", "rng", "args"):
        print(f"  {what + ':':<11} {holds.get(what, 'no')}", file=out)
    if t["other_state"]:
        print(f"  {'other:':<11} {', '.join(t['other_state'])}", file=out)
    if not long:
        print(f"details:      megashard inspect --long {s.get('path')}", file=out)
        return
    print(f"objects:      {len(s.get('objects', []))}; distinct rank state trees: {s.get('distinct_rank_trees')}",
          file=out)
    print("files:", file=out)
    files = s.get("files", {})
    width = max((len(n) for n in files), default=0)
    for name, info in files.items():
        print(f"  {name:<{width}}  rank {info.get('rank')}, {_human_bytes(int(info.get('bytes', 0)))}, "
              f"{info.get('tensors')} tensors", file=out)
    print("tensors:", file=out)
    tensors = s.get("tensors", {})
    rows = [(k, v["dtype"], "[" + ", ".join(map(str, v["shape"])) + "]", _human_bytes(v["bytes"]),
             f"{v['shards']} shard{'s' if v['shards'] != 1 else ''}") for k, v in tensors.items()]
    widths = [max((len(r[c]) for r in rows), default=0) for c in range(4)]
    for r in rows:
        print("  " + "  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + f"{r[3]}, {r[4]}", file=out)


def _checkpoint_tools() -> Any:
    try:
        return importlib.import_module("megashard.checkpoint_tools")
    except ImportError as e:
        raise MegashardError(f"checkpoint directory support is unavailable: {e}") from e


def _is_moved_checkpoint(path: str) -> bool:
    """A checkpoint whose directory is missing but whose interrupted re-save left a complete copy."""
    return not os.path.lexists(path) and storage.locate(path) is not None


def _is_checkpoint_arg(path: str) -> bool:
    """A checkpoint or Megatron save root (directory or URL), not a single ``.tensors`` file."""
    return storage.is_url(path) or os.path.isdir(path) or _is_moved_checkpoint(path)


def _print_save_root(root: dict[str, Any], out: TextIO) -> None:
    its = ", ".join(str(i) for i in root["iterations"]) or "none"
    named = (f"the tracker names {root['tracker']}" if root["tracker"] is not None
             else f"no {saveroot.TRACKER_NAME}")
    print(f"save root:    {root['path']}", file=out)
    print(f"iterations:   {its} ({named})", file=out)


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = args.path
    if _is_checkpoint_arg(path):
        summary = _checkpoint_tools().inspect_checkpoint(path)
        if args.json:
            print(json.dumps(summary, indent=2, default=str))
            return 0
        if isinstance(summary.get("save_root"), dict):
            _print_save_root(summary["save_root"], sys.stdout)
            summary = {k: v for k, v in summary.items() if k != "save_root"}
        if summary:
            _print_checkpoint_summary(summary, sys.stdout, long=args.long)
        return 0
    summary = _file_summary(path)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_file_summary(summary, sys.stdout)
    return 0


class _Progress:
    """A tqdm bar of bytes on stderr, only when stderr is a terminal (never in a pipe or a log);
    callable as ``progress(done, total)``, or None where there is no terminal."""

    def __init__(self, label: str) -> None:
        self.label, self.bar = label, None

    def __enter__(self) -> Any:
        return self if sys.stderr.isatty() else None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.label, unit="B", unit_scale=True, unit_divisor=1000,
                            file=sys.stderr, leave=False, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _cmd_verify(args: argparse.Namespace) -> int:
    path = args.path
    root = None
    if _is_checkpoint_arg(path):
        root = storage.save_root(path)
        if root is not None:
            path = storage.root_checkpoint(root)  # the one its tracker names
        with _Progress(f"verify {os.path.basename(path)}") as progress:
            problems = list(_checkpoint_tools().verify_checkpoint(path, progress=progress))
        count = None
    else:
        from .format import open_file
        from .format.verify import structure_problems

        with open_file(path) as r:
            problems = structure_problems(r) + r.verify_all()
            count = len(r)
    if args.json:
        print(json.dumps({"path": path, "ok": not problems, "tensors": count, "problems": problems}, indent=2))
    elif problems:
        for p in problems:
            print(f"FAILED: {p}")
        print(f"{path}: {len(problems)} problem(s)")
    else:
        what = f"{count} tensors, all hashes match" if count is not None else "checkpoint verified"
        if root is not None:
            what += f" (iteration {root['tracker']}, named by {root['path']}'s tracker)"
        print(f"OK: {path}: {what}")
    return 1 if problems else 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert

    res = convert(args.src, args.dst, to=args.to, keys=args.keys, iteration=args.iteration,
                  vocab_size=args.vocab_size, tokenizer=args.tokenizer, hf_tensors=args.tensors,
                  shard_bytes=args.max_shard_size)
    print(res.summary())
    return 0


class _Paths(argparse.Action):
    """convert's SRC DST; notes whether ``--keys`` came first (its list then ends with them)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, list(values))
        namespace.keys_before_paths = getattr(namespace, "keys", None) is not None


def _convert_paths(args: argparse.Namespace, extras: list) -> None:
    """SRC and DST for ``convert``: ``--keys A B SRC DST`` takes every word up to the next option, so
    the paths it swallowed are the end of its list (the exactly two paths come first)."""
    parser = args.convert_parser
    paths = args.paths + extras
    unknown = [a for a in extras if a.startswith("-")] or paths[2:]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    need = 2 - len(paths)
    if need:
        keys = args.keys or []
        if len(keys) <= need:
            parser.error("--keys needs at least one PATTERN before SRC DST" if keys else
                         "the following arguments are required: SRC DST")
        args.keys, taken = keys[:-need], keys[-need:]
        paths = taken + paths if getattr(args, "keys_before_paths", False) else paths + taken
    args.src, args.dst = paths


def _cmd_copy(args: argparse.Namespace) -> int:
    from .copy import copy

    print(copy(args.src, args.dst, iteration=args.iteration, all_iterations=args.all, sha256=args.sha256).summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="megashard", description="Inspect and verify megashard "
                                "checkpoints and tensorizer .tensors files.")
    p.add_argument("--version", action="version", version=f"megashard {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    i = sub.add_parser("inspect", help="show a .tensors file's tensors, or a checkpoint directory's summary")
    i.add_argument("path", help=".tensors file, checkpoint or Megatron save root (directory or s3:// URL)")
    i.add_argument("--json", action="store_true", help="machine-readable output (every detail)")
    i.add_argument("-l", "--long", action="store_true", help="a checkpoint: also every file and global tensor")
    i.set_defaults(func=_cmd_inspect)
    v = sub.add_parser("verify", help="check every CRC32/SHA-256; exit 1 if any mismatch")
    v.add_argument("path", help=".tensors file, checkpoint or Megatron save root (directory or s3:// URL)")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=_cmd_verify)
    c = sub.add_parser("convert", help="torch_dist -> megashard, megashard -> torch_dist, one .tensors / "
                       ".safetensors file of global tensors, a Hugging Face directory (--to hf), or a Hugging "
                       "Face directory -> megashard (one process)",
                       usage="%(prog)s SRC DST [--to FORMAT] [--keys PATTERN [PATTERN ...]] [--iteration N] "
                       "[--vocab-size N] [--tokenizer DIR] [--tensors] [--max-shard-size BYTES]")
    c.add_argument("paths", nargs="*", metavar="SRC DST", action=_Paths,
                   help="SRC: checkpoint directory, a Megatron save directory with iter_XXXXXXX subdirectories, "
                   "or a Hugging Face model directory (imported); DST: new directory (or file for "
                   "tensors/safetensors), must not exist")
    c.add_argument("--to", default="megashard", choices=("megashard", "torch_dist", "tensors", "safetensors", "hf"),
                   help="target format (default: megashard; a Hugging Face directory as SRC is imported)")
    c.add_argument("--keys", nargs="+", metavar="PATTERN", help="only global tensors matching these keys / globs")
    c.add_argument("--iteration", type=int, help="iteration to convert from a Megatron save directory "
                   "(default: the tracker's)")
    c.add_argument("--vocab-size", type=int, help="--to hf: the real vocabulary size (the checkpoint's is padded; "
                   "default: the saved args' vocab_size when they hold it, and a smaller one is refused)")
    c.add_argument("--tokenizer", metavar="DIR", help="--to hf: tokenizer directory; its files are copied and "
                   "its tokenizer.json gives the vocabulary size")
    c.add_argument("--tensors", action="store_true", help="--to hf: one tensorizer model.tensors file of "
                   "HF-named tensors (vLLM --load-format tensorizer) instead of safetensors shards")
    c.add_argument("--max-shard-size", type=int, metavar="BYTES", help="--to hf: safetensors shard size "
                   "(default 5e9)")
    c.set_defaults(func=_cmd_convert, convert_parser=c)
    k = sub.add_parser("copy", help="copy a checkpoint or a Megatron save root between directories and s3:// "
                       "(streamed, every tensor's CRC32 checked on the way, committed atomically as a save)")
    k.add_argument("src", help="checkpoint or Megatron save root: a directory or s3:// URL")
    k.add_argument("dst", help="where the checkpoint (or DST/iter_XXXXXXX and the tracker) goes: absent or a "
                   "megashard checkpoint, which is replaced as a save would")
    k.add_argument("--iteration", type=_iteration, help="save root: copy this iteration (default: the tracker's)")
    k.add_argument("--all", action="store_true", help="save root: copy every committed iteration")
    k.add_argument("--sha256", action="store_true", help="also check every tensor's SHA-256 (slower)")
    k.set_defaults(func=_cmd_copy)
    r = sub.add_parser("recover", help="finish an interrupted re-save: put the complete copy back in place, "
                       "remove superseded copies and dead saves' temporaries, and list what was removed (the only "
                       "command that changes a checkpoint's directory)")
    r.add_argument("path", help="checkpoint or Megatron save root (every iteration): directory or s3:// URL")
    r.add_argument("--older-than", type=float, default=storage.DEFAULT_STALE_AGE_S, metavar="SECONDS",
                   help="remove what saves that did not finish left once older than this: at s3://, their objects "
                   "and unfinished multipart uploads; on a file system, temp dirs whose owner is not provably dead "
                   "(another machine's, or none; a dead owner on this machine's go at once) (default: one day; 0 "
                   "when no save of it can be running)")
    r.set_defaults(func=_cmd_recover)
    return p


def _iteration(text: str) -> int | str:
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an iteration number or 'release'") from None


def _cmd_recover(args: argparse.Namespace) -> int:
    rec = storage.recover_path(args.path, older_than_s=args.older_than)
    for final, copy in rec.restored:
        print(f"restored {final} from {copy}")
    for gone in rec.removed:
        print(f"removed {gone} ({storage.leftover_kind(gone)})")
    root = rec.root
    if root is not None and root["iterations"]:
        tracked = (f"tracker names iteration {root['tracker']}" if root["tracker"] is not None
                   else f"no {saveroot.TRACKER_NAME}")
        print(f"OK: {root['path']}: save root, {tracked}; iterations {', '.join(map(str, root['iterations']))}")
        return 0
    if rec.found is None:
        print(f"{args.path}: no complete checkpoint found", file=sys.stderr)
        return 1
    print(f"OK: {rec.found}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if args.command == "convert":
        _convert_paths(args, extras)
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    for attr in ("path", "src", "dst"):
        if isinstance(getattr(args, attr, None), str):
            try:
                storage.location(getattr(args, attr))
            except MegashardError as e:
                print(f"megashard {args.command}: error: {e}", file=sys.stderr)
                return 2
    if (args.command in ("inspect", "verify") and not storage.is_url(args.path) and not os.path.exists(args.path)
            and not _is_moved_checkpoint(args.path)):
        print(f"megashard {args.command}: error: {args.path}: no such file or directory", file=sys.stderr)
        return 1
    try:
        return int(args.func(args))
    except MegashardError as e:
        from .convert import ConvertInputError
        from .copy import CopyInputError

        if isinstance(e, (ConvertInputError, CopyInputError)):  # nothing was written
            print(f"megashard {args.command}: error: {e}", file=sys.stderr)
            return 2
        print(f"megashard {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `megashard inspect f | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
