"""Megatron-LM's own ``pretrain_gpt.py`` with the two lines a user adds for megashard.

Run with torchrun; needs a Megatron-LM source tree matching the installed megatron-core
in ``MEGATRON_LM_DIR`` (tests/test_megatron_lm_install.py extracts the vendored one).
Each ``main_core_v0_*`` below is the stock script's ``__main__`` block of that release with
the two lines a user adds (marked ``<- line``), plus the test-only switches of
:func:`_test_hooks` (environment variables; unset, they do nothing); core_v0.16.x::

    import megashard.megatron as msm
    msm.install()
    pretrain(..., extra_args_provider=msm.add_arguments, ...)

core_v0.19.x (arguments are parsed in the script)::

    import megashard.megatron as msm
    msm.install()
    args = parse_and_validate_args(extra_args_provider=msm.with_arguments(<the script's provider>), ...)
"""
from __future__ import annotations

import os
import sys
import time
import types
from functools import partial

# torch.compile (Megatron's jit_fuser / JIT warm-up) would try to build kernels for the
# fake "cuda" device; eager mode is what we test
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository (megashard)
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (megatron_helpers)
MLM = os.environ.get("MEGATRON_LM_DIR")
if MLM:
    # appended, not prepended: `megatron` is a namespace package, so with the tree last
    # megatron.core still comes from the installed wheel (whose dataset helpers are
    # compiled) and only megatron.training / pretrain_gpt.py come from the tree
    sys.path.append(MLM)

from megatron_helpers import mlm_stubs  # noqa: E402

mlm_stubs.install()

from megashard.megatron import cpu_compat  # noqa: E402

if cpu_compat.apply():
    from megatron_helpers import mlm_cpu

    mlm_cpu.apply()  # Megatron-LM's training loop on CPU: test-only extra patches


def _test_hooks() -> "callable":
    """Test-only switches, from the environment (tests/test_megatron_lm_ranks.py); none set: no effect.

    ``MEGASHARD_TEST_RANK_CWD=D``: rank R runs in ``D/rank<R>`` (a relative ``--load`` then
    names a different directory on each rank); ``MEGASHARD_TEST_FAIL=<name>@<R>``:
    ``megashard.megatron.state.<name>`` raises on rank R; ``MEGASHARD_TEST_OUTCOME=D``: each
    rank writes how ``pretrain()`` ended to ``D/rank<R>.json`` (the returned function);
    ``MEGASHARD_TEST_KILL_AT=N`` (in ``__main__``): every rank SIGKILLs itself during the step after
    iteration N (once the local tier's background replication of N and an ``--async-save`` in flight,
    if any, are done);
    ``MEGASHARD_TEST_NODE_PER_RANK=1``: rank R is alone on node ``node<R>`` (``MEGASHARD_NODE_ID``).
    """
    import json
    import time

    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("MEGASHARD_TEST_NODE_PER_RANK"):
        os.environ["MEGASHARD_NODE_ID"] = f"node{rank}"
    cwd = os.environ.get("MEGASHARD_TEST_RANK_CWD")
    if cwd:
        os.chdir(os.path.join(cwd, f"rank{rank}"))
    fail = os.environ.get("MEGASHARD_TEST_FAIL")
    if fail and int(fail.rsplit("@", 1)[1]) == rank:
        from megashard.megatron import state

        name = fail.rsplit("@", 1)[0]

        def boom(*a, **k):
            raise RuntimeError(f"injected failure in {name} on rank {rank}")

        setattr(state, name, boom)
    t0 = time.monotonic()

    def record(error: "BaseException | None") -> None:
        out = os.environ.get("MEGASHARD_TEST_OUTCOME")
        if out:
            info = {"ok": error is None, "seconds": time.monotonic() - t0}
            if error is not None:
                info.update(type=type(error).__name__, mro=[c.__name__ for c in type(error).__mro__],
                            message=str(error)[:8000])
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump(info, f)

    return record


def main_core_v0_16(P: types.ModuleType) -> None:
    """Megatron-LM core_v0.16.x's ``__main__``: ``pretrain()`` parses the arguments itself."""
    import megashard.megatron as msm

    msm.install()  # <- line 1 a Megatron-LM user adds

    P.set_startup_timestamps(program_start=time.time(), main_entry=time.time())
    P.train_valid_test_datasets_provider.is_distributed = True
    P.pretrain(
        P.train_valid_test_datasets_provider,
        partial(P.model_provider, P.gpt_builder),
        P.ModelType.encoder_or_decoder,
        P.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=msm.add_arguments,  # <- line 2 a Megatron-LM user adds
        get_embedding_ranks=P.get_embedding_ranks,
    )


def main_core_v0_19(P: types.ModuleType) -> None:
    """Megatron-LM core_v0.19.x's ``__main__``: arguments are parsed by ``parse_and_validate_args``
    in the script and ``pretrain()`` takes the config container built from them."""
    import megashard.megatron as msm

    msm.install()  # <- line 1 a Megatron-LM user adds

    P.set_startup_timestamps(program_start=time.time(), main_entry=time.time())
    setattr(P.train_valid_test_datasets_provider, "is_distributed", True)
    pretrain, store = P.inprocess_restart.maybe_wrap_for_inprocess_restart(P.pretrain)
    args = P.parse_and_validate_args(
        # <- line 2 a Megatron-LM user adds: megashard's flags beside the script's own provider
        extra_args_provider=msm.with_arguments(P.add_modelopt_args if P.has_nvidia_modelopt else None),
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    if P.has_nvidia_modelopt:
        P.maybe_enable_modelopt(args)
    model_cfg = P.gpt_config_from_args(args)
    full_config = P.pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(
        full_config,
        P.train_valid_test_datasets_provider,
        P.ModelType.encoder_or_decoder,
        P.forward_step,
        store=store,
        get_embedding_ranks=P.get_embedding_ranks,
    )


if __name__ == "__main__":
    record = _test_hooks()

    import megatron.core
    import megatron.training

    import pretrain_gpt as P  # Megatron-LM's script, imported (its __main__ does not run)

    cpu_compat.cover(P)  # its get_batch calls .cuda(): the CPU stand-ins (no-op with CUDA)
    if os.environ.get("MEGASHARD_TEST_KILL_AT"):
        # test-only: every rank SIGKILLs itself in the forward pass of the step after iteration N
        _forward_step, _kill_at = P.forward_step, int(os.environ["MEGASHARD_TEST_KILL_AT"])

        def forward_step(*a, **k):
            from megatron.training import get_args

            if get_args().curr_iteration == _kill_at:
                import signal

                from megatron.training.async_utils import maybe_finalize_async_save

                from megashard.megatron.checkpointing import wait_for_replication

                # deterministic: the kill of a replication in flight is tests/test_replication.py's, of an
                # async save tests/test_async_save.py's
                maybe_finalize_async_save(blocking=True)
                wait_for_replication()

                os.kill(os.getpid(), signal.SIGKILL)
            return _forward_step(*a, **k)

        P.forward_step = forward_step

    if os.environ.get("RANK", "0") == "0":  # the test checks where each part came from
        print(f"megatron.core from {os.path.dirname(megatron.core.__file__)} | "
              f"megatron.training from {os.path.dirname(megatron.training.__file__)} | "
              f"pretrain_gpt from {os.path.abspath(P.__file__)}", flush=True)
    # the script's own entry point tells the release apart (core_v0.19.0 parses in __main__)
    try:
        (main_core_v0_19 if hasattr(P, "parse_and_validate_args") else main_core_v0_16)(P)
    except BaseException as e:
        record(e)
        raise
    record(None)
