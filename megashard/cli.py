"""The ``megashard`` command line: inspect and verify `.tensors` files and checkpoints.

    megashard inspect PATH [--json]   # a file: version + tensors; a directory: the checkpoint summary
    megashard verify PATH [--json]    # every hash; exit 0 only when all match, else 1
    megashard convert SRC DST [--to megashard|torch_dist|tensors|safetensors|hf] [--keys PATTERN ...]
                      [--iteration N]  # one process; see megashard.convert
    megashard convert SRC DST --to hf (--vocab-size N | --tokenizer DIR) [--tensors]  # a Hugging Face directory
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

from . import storage
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
                    "sha256": i.sha256,
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


def _print_checkpoint_summary(s: dict[str, Any], out: TextIO) -> None:
    """Totals first (size, files, tensors, layout, iteration, contents), then the details."""
    t = s.get("totals")
    if not isinstance(t, dict):
        _print_nested(s, out)
        return
    print(f"checkpoint:   {s.get('path')}", file=out)
    print(f"size:         {t['bytes']} bytes ({_human_bytes(t['bytes'])}) in {t['files']} files", file=out)
    print(f"tensors:      {t['global_tensors']} global tensors in {t['shards']} shards", file=out)
    print(f"layout:       {t['layout']} (saved by {t['world_size']} ranks)", file=out)
    print(f"iteration:    {t['iteration'] if t['iteration'] is not None else 'unknown'}", file=out)
    print("holds:", file=out)
    holds = t["holds"]
    for what in ("model", "optimizer", "rng", "args"):
        print(f"  {what + ':':<11} {holds.get(what, 'no')}", file=out)
    if t["other_state"]:
        print(f"  {'other:':<11} {', '.join(t['other_state'])}", file=out)
    print("", file=out)
    _print_nested({k: v for k, v in s.items() if k not in ("totals", "path")}, out)


def _checkpoint_tools() -> Any:
    try:
        return importlib.import_module("megashard.checkpoint_tools")
    except ImportError as e:
        raise MegashardError(f"checkpoint directory support is unavailable: {e}") from e


def _is_moved_checkpoint(path: str) -> bool:
    """A checkpoint whose directory is missing but whose interrupted re-save left a complete copy."""
    return not os.path.lexists(path) and storage.locate(path) is not None


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = args.path
    if os.path.isdir(path) or _is_moved_checkpoint(path):
        summary = _checkpoint_tools().inspect_checkpoint(path)
        if args.json:
            print(json.dumps(summary, indent=2, default=str))
        else:
            _print_checkpoint_summary(summary, sys.stdout)
        return 0
    summary = _file_summary(path)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_file_summary(summary, sys.stdout)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    path = args.path
    if os.path.isdir(path) or _is_moved_checkpoint(path):
        problems = list(_checkpoint_tools().verify_checkpoint(path))
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
        print(f"OK: {path}: {what}")
    return 1 if problems else 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert

    res = convert(args.src, args.dst, to=args.to, keys=args.keys, iteration=args.iteration,
                  vocab_size=args.vocab_size, tokenizer=args.tokenizer, hf_tensors=args.tensors,
                  shard_bytes=args.max_shard_size)
    print(res.summary())
    return 0


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
    i.add_argument("path", help=".tensors file or checkpoint directory")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=_cmd_inspect)
    v = sub.add_parser("verify", help="check every CRC32/SHA-256; exit 1 if any mismatch")
    v.add_argument("path", help=".tensors file or checkpoint directory")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=_cmd_verify)
    c = sub.add_parser("convert", help="torch_dist -> megashard, megashard -> torch_dist, one .tensors / "
                       ".safetensors file of global tensors, a Hugging Face directory (--to hf), or a Hugging "
                       "Face directory -> megashard (one process)")
    c.add_argument("src", help="checkpoint directory, a Megatron save directory with iter_XXXXXXX subdirectories, "
                   "or a Hugging Face model directory (imported)")
    c.add_argument("dst", help="new directory (or file for tensors/safetensors); must not exist")
    c.add_argument("--to", default="megashard", choices=("megashard", "torch_dist", "tensors", "safetensors", "hf"),
                   help="target format (default: megashard; a Hugging Face directory as SRC is imported)")
    c.add_argument("--keys", nargs="+", metavar="PATTERN", help="only global tensors matching these keys / globs")
    c.add_argument("--iteration", type=int, help="iteration to convert from a Megatron save directory "
                   "(default: the tracker's)")
    c.add_argument("--vocab-size", type=int, help="--to hf: the real vocabulary size (the checkpoint's is padded)")
    c.add_argument("--tokenizer", metavar="DIR", help="--to hf: tokenizer directory; its files are copied and "
                   "its tokenizer.json gives the vocabulary size")
    c.add_argument("--tensors", action="store_true", help="--to hf: one tensorizer model.tensors file of "
                   "HF-named tensors (vLLM --load-format tensorizer) instead of safetensors shards")
    c.add_argument("--max-shard-size", type=int, metavar="BYTES", help="--to hf: safetensors shard size "
                   "(default 5e9)")
    c.set_defaults(func=_cmd_convert)
    k = sub.add_parser("copy", help="copy a checkpoint or a Megatron save root between directories and s3:// "
                       "(streamed, every tensor's CRC32 checked on the way, committed atomically as a save)")
    k.add_argument("src", help="checkpoint or Megatron save root: a directory or s3:// URL")
    k.add_argument("dst", help="where the checkpoint (or DST/iter_XXXXXXX and the tracker) goes: absent or a "
                   "megashard checkpoint, which is replaced as a save would")
    k.add_argument("--iteration", type=_iteration, help="save root: copy this iteration (default: the tracker's)")
    k.add_argument("--all", action="store_true", help="save root: copy every committed iteration")
    k.add_argument("--sha256", action="store_true", help="also check every tensor's SHA-256 (slower)")
    k.set_defaults(func=_cmd_copy)
    r = sub.add_parser("recover", help="finish an interrupted re-save: put the complete copy back in place and "
                       "remove superseded copies (the only command that changes a checkpoint's directory)")
    r.add_argument("path", help="checkpoint directory, or s3:// URL")
    r.add_argument("--older-than", type=float, default=storage.DEFAULT_STALE_AGE_S, metavar="SECONDS",
                   help="s3://: remove what saves that did not finish left (their objects, unfinished multipart "
                   "uploads) once older than this (default: one day; 0 when no save of it can be running)")
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
    found = storage.recover(args.path, older_than_s=args.older_than)
    if found is None:
        print(f"{args.path}: no complete checkpoint found", file=sys.stderr)
        return 1
    print(f"OK: {found}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
