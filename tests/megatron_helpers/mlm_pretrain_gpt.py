"""Megatron-LM's own ``pretrain_gpt.py`` with the two lines a user adds for megashard.

Run with torchrun; needs a Megatron-LM source tree matching the installed megatron-core
in ``MEGATRON_LM_DIR`` (tests/test_megatron_lm_install.py extracts the vendored one).
Identical to the stock script's ``__main__`` block except for::

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

if __name__ == "__main__":
    import time
    from functools import partial

    import megatron.core
    import megatron.training

    import pretrain_gpt as P  # Megatron-LM's script, imported (its __main__ does not run)

    cpu_compat.cover(P)  # its get_batch calls .cuda(): the CPU stand-ins (no-op with CUDA)

    if os.environ.get("RANK", "0") == "0":  # the test checks where each part came from
        print(f"megatron.core from {os.path.dirname(megatron.core.__file__)} | "
              f"megatron.training from {os.path.dirname(megatron.training.__file__)}", flush=True)

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
