"""Megatron-LM's own ``pretrain_gpt.py`` with the two lines a user adds for megashard.

Run with torchrun; needs a Megatron-LM source tree matching the installed megatron-core
in ``MEGATRON_LM_DIR`` (tests/test_megatron_lm_install.py extracts the vendored one).
Identical to the stock script's ``__main__`` block except for the test-only switches of
:func:`_test_hooks` (environment variables; unset, they do nothing) and::

    import megashard.megatron as msm
    msm.install()
    pretrain(..., extra_args_provider=msm.add_arguments, ...)
"""
from __future__ import annotations

import os
import sys

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
    rank writes how ``pretrain()`` ended to ``D/rank<R>.json`` (the returned function).
    """
    import json
    import time

    rank = int(os.environ.get("RANK", "0"))
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


if __name__ == "__main__":
    import time
    from functools import partial

    record = _test_hooks()

    import megatron.core
    import megatron.training

    import pretrain_gpt as P  # Megatron-LM's script, imported (its __main__ does not run)

    if os.environ.get("RANK", "0") == "0":  # the test checks where each part came from
        print(f"megatron.core from {os.path.dirname(megatron.core.__file__)} | "
              f"megatron.training from {os.path.dirname(megatron.training.__file__)}", flush=True)

    import megashard.megatron as msm

    msm.install()  # <- line 1 a Megatron-LM user adds

    P.set_startup_timestamps(program_start=time.time(), main_entry=time.time())
    P.train_valid_test_datasets_provider.is_distributed = True
    try:
        P.pretrain(
            P.train_valid_test_datasets_provider,
            partial(P.model_provider, P.gpt_builder),
            P.ModelType.encoder_or_decoder,
            P.forward_step,
            args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
            extra_args_provider=msm.add_arguments,  # <- line 2 a Megatron-LM user adds
            get_embedding_ranks=P.get_embedding_ranks,
        )
    except BaseException as e:
        record(e)
        raise
    record(None)
