"""``cpu_compat.apply()`` changes nothing outside megatron-core.

A small ``transformers`` Llama (random weights, saved with ``save_pretrained`` and read back with
``from_pretrained``) gives bit-identical logits with and without ``apply()`` in the same process:
torch's functions and classes are the same objects after ``apply()``, and only modules of
megatron see CPU stand-ins for CUDA.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from megatron_helpers.runner import REPO, TESTS

LLAMA = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path, mode = sys.argv[1], sys.argv[2]
    if mode == "reference":  # no megashard in this process
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        LlamaForCausalLM(cfg).save_pretrained(path)
    else:
        torch_fns = {n: getattr(torch, n) for n in ("tensor", "zeros", "arange", "empty", "ones", "full")}
        cuda_fns = {n: getattr(torch.cuda, n) for n in ("current_device", "synchronize", "get_rng_state",
                                                        "manual_seed", "is_available", "Stream", "Event")}
        methods = {n: getattr(torch.Tensor, n) for n in ("to", "cuda", "type")}
        from megashard.megatron import cpu_compat
        import megatron.core.tensor_parallel  # noqa: F401 - megatron modules get the CPU stand-ins
        assert cpu_compat.apply() is True
        changed = [n for n, f in torch_fns.items() if getattr(torch, n) is not f]
        changed += ["cuda." + n for n, f in cuda_fns.items() if getattr(torch.cuda, n) is not f]
        print("changed " + json.dumps(changed))
    model = LlamaForCausalLM.from_pretrained(path)  # after apply() in the second process
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 17).reshape(2, 8)).logits
    torch.save(logits, f"{path}/{mode}.pt")
    """
)


def _run(path: str, mode: str) -> str:
    p = subprocess.run([sys.executable, "-c", LLAMA, path, mode], capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": f"{REPO}:{TESTS}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                            "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


def test_transformers_llama_logits_unchanged_after_apply(tmp_path):
    import torch

    path = str(tmp_path / "llama")
    _run(path, "reference")
    out = _run(path, "apply")
    ref, got = torch.load(f"{path}/reference.pt"), torch.load(f"{path}/apply.pt")
    assert torch.equal(ref, got), f"logits differ after apply(): max {(ref - got).abs().max().item()}"
    changed = json.loads(out.split("changed ", 1)[1].splitlines()[0])
    assert changed == [], f"cpu_compat.apply() replaced torch functions process-wide: {changed}"
