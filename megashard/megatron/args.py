"""Command-line flags for megashard, usable as Megatron-LM's ``extra_args_provider``.

Megatron-LM has no hook for a new checkpoint format (``--ckpt-format`` is a closed
list and an unknown value crashes in ``save_checkpoint``), so megashard adds its own
``--save-format`` flag instead of extending ``--ckpt-format``.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

SAVE_FORMATS = ("torch_dist", "torch", "tensors")
LOAD_MODES = ("auto", "own", "scatter", "readonce")


def _has(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions  # noqa: SLF001 - argparse has no public query


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--save-format`` and megashard's options to ``parser``; return it.

    Signature matches Megatron-LM's ``extra_args_provider`` (``parser -> parser``).
    Flags already defined on ``parser`` are left alone, so calling this twice, or on
    a parser that defines some of them, is safe.
    """
    group = parser.add_argument_group(title="megashard checkpointing")
    if not _has(parser, "--save-format"):
        group.add_argument(
            "--save-format", type=str, default=None, choices=SAVE_FORMATS,
            help="Checkpoint format for --save. 'tensors' writes megashard checkpoints "
                 "(tensorizer .tensors shards + JSON manifest, no pickle); 'torch_dist' and "
                 "'torch' use Megatron's own writers (default: Megatron's --ckpt-format). "
                 "--load detects a megashard checkpoint by itself.",
        )
    if not _has(parser, "--megashard-load-mode"):
        group.add_argument(
            "--megashard-load-mode", type=str, default="auto", choices=LOAD_MODES,
            help="How megashard reads a checkpoint: 'own' (every rank reads its own byte "
                 "ranges), 'scatter' (one reader per node streams to the node's ranks), "
                 "'readonce' (every byte read once per job, by ranks on every node, then exchanged), "
                 "'auto' (own on one node, readonce on several when every rank sees the checkpoint, "
                 "else scatter).",
        )
    if not _has(parser, "--megashard-verify-on-load"):
        group.add_argument(
            "--megashard-verify-on-load", action="store_true", default=False,
            help="Also re-read, after the load, every file region it read and check its structure, "
                 "CRC32 and SHA-256 (covers bytes a resharding load reads only in part).",
        )
    if not _has(parser, "--megashard-no-crc-on-load"):
        group.add_argument(
            "--megashard-no-crc-on-load", dest="megashard_crc_on_load", action="store_false", default=True,
            help="Skip the CRC32 check of every saved tensor a load reads whole (on by default: a flipped "
                 "bit fails the resume, naming the file and tensor, instead of training on).",
        )
    if not _has(parser, "--megashard-non-strict-load"):
        group.add_argument(
            "--megashard-non-strict-load", dest="megashard_strict_load", action="store_false",
            default=True,
            help="Tolerate tensors missing from the checkpoint (they keep their current "
                 "values and are listed in the log) instead of failing.",
        )
    if not _has(parser, "--megashard-direct-io"):
        group.add_argument(
            "--megashard-direct-io", action="store_true", default=False,
            help="Write the bulk of every large tensor with O_DIRECT, bypassing the page cache: "
                 "saves allocate and dirty no page cache for it (faster where the page cache is "
                 "the bottleneck, e.g. VMs), but a load on the same node afterwards reads from disk.",
        )
    if not _has(parser, "--megashard-no-sha256"):
        group.add_argument(
            "--megashard-no-sha256", dest="megashard_sha256", action="store_false", default=None,
            help="Write CRC32-only tensor headers (tensorizer's one-hash variant; its readers and every "
                 "megashard check accept them) and skip computing SHA-256, most of a save's CPU time. "
                 "Default: MEGASHARD_SHA256 (unset: CRC32 and SHA-256).",
        )
    if not _has(parser, "--async-save"):  # Megatron-LM defines it; stand-alone scripts get it here
        group.add_argument(
            "--async-save", action="store_true", default=None,
            help="Save asynchronously: training stalls only while every rank copies its state "
                 "into reused staging memory; files are written in a background thread and the "
                 "checkpoint is committed (and the tracker written) when the save is finalized.",
        )
    return parser


def with_arguments(provider: Optional[Callable[[argparse.ArgumentParser], Any]] = None
                   ) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that runs ``provider`` (if any), then :func:`add_arguments`.

    For Megatron-LM scripts that already pass a provider of their own, e.g. core_v0.19's
    ``pretrain_gpt.py``: ``parse_and_validate_args(extra_args_provider=msm.with_arguments(
    add_modelopt_args if has_nvidia_modelopt else None), ...)``.
    """
    def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if provider is not None:
            parser = provider(parser)
        return add_arguments(parser)

    return extra_args_provider


def uses_megashard_save(args: Any) -> bool:
    """True when ``--save-format tensors`` was given."""
    return getattr(args, "save_format", None) == "tensors"


def megatron_save_format(args: Any) -> Optional[str]:
    """The Megatron ``--ckpt-format`` a non-megashard ``--save-format`` maps to (or None)."""
    fmt = getattr(args, "save_format", None)
    return fmt if fmt in ("torch_dist", "torch") else None


def take_local_checkpointing(args: Any) -> bool:
    """With ``--save-format tensors`` and ``--non-persistent-ckpt-type local``: megashard saves
    the non-persistent checkpoints to its local tier, so Megatron's validation (which requires
    nvidia-resiliency-ext for ``local``) and its ``LocalCheckpointManager`` are kept out: the
    directory moves to ``args.megashard_local_ckpt_dir`` (the replication flags, if any, to
    ``args.megashard_replication``) and Megatron sees no non-persistent type. Call it before
    Megatron's ``validate_args``. True when it took them."""
    from megashard.errors import CheckpointError

    if not uses_megashard_save(args) or getattr(args, "non_persistent_ckpt_type", None) != "local":
        return False
    where = getattr(args, "non_persistent_local_ckpt_dir", None)
    if not where:
        raise CheckpointError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR "
                              "(a directory on each node, e.g. /dev/shm/ckpt or local NVMe)")
    if getattr(args, "replication", False) and not getattr(args, "replication_jump", None):
        raise CheckpointError("--replication requires --replication-jump J (the spacing of a rank's replicas: "
                              "the number of ranks per node puts them on other nodes), as Megatron does")
    args.megashard_local_ckpt_dir = str(where)
    args.megashard_replication = ([getattr(args, "replication_jump", None), getattr(args, "replication_factor", 2)]
                                  if getattr(args, "replication", False) else None)
    args.non_persistent_ckpt_type = None
    args.replication, args.replication_jump = False, None
    return True

