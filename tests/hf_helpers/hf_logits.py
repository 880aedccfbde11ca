"""transformers' side of the HF tests, in its own process (Megatron's cpu_compat changes torch
process-wide): load an HF directory (or a tensorizer file of HF-named tensors with its
config.json) and write the logits of the same fixed tokens hf_llama.py uses.

    python hf_logits.py DIR OUT [--tensors FILE] [--seq N] [--also DIR2 OUT2 ...]
    python hf_logits.py --make DIR [OUT] [--layers ...] [--experts E --topk K]   # a random HF Llama / Mixtral

``--also`` (repeatable) and ``--make DIR OUT`` (make, then load DIR back and write its logits) do in one
process what would otherwise take another start of Python, torch and transformers (seconds each).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def tokens(vocab: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)  # the same draw as hf_llama.logits()
    return torch.randint(0, vocab, (2, seq), generator=g)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("out", nargs="?")
    p.add_argument("--tensors")
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--make", action="store_true")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ffn", type=int, default=96)
    p.add_argument("--vocab", type=int, default=200)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--bias", action="store_true")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--experts", type=int, default=0, help="--make: a MixtralForCausalLM with this many experts")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--eps", type=float, default=1e-5, help="--make: rms_norm_eps")
    p.add_argument("--also", nargs=2, action="append", default=[], metavar=("DIR", "OUT"),
                   help="the logits of another HF directory too")
    o = p.parse_args()
    if o.make:
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig

        torch.manual_seed(11)
        common = dict(vocab_size=o.vocab, hidden_size=o.hidden, intermediate_size=o.ffn,
                      num_hidden_layers=o.layers, num_attention_heads=o.heads, num_key_value_heads=o.groups,
                      max_position_embeddings=64, rms_norm_eps=o.eps, tie_word_embeddings=o.tied)
        if o.experts:
            cfg = MixtralConfig(**common, num_local_experts=o.experts, num_experts_per_tok=o.topk)
            model = AutoModelForCausalLM.from_config(cfg)
        else:
            model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=o.bias, mlp_bias=o.bias))
        with torch.no_grad():
            for _, prm in sorted(model.named_parameters()):
                prm.copy_(prm + 0.1 * torch.randn(prm.shape))  # norms and biases not trivially 1 / 0
        model.to(getattr(torch, o.dtype)).save_pretrained(o.dir)
        if o.out is None:
            return 0
        del model  # the logits below are of the model as loaded back from o.dir
    for d, out in [(o.dir, o.out), *o.also]:
        write_logits(load(d, o.tensors if d == o.dir else None), o.seq, out)
    return 0


def load(d: str, tensors: "str | None") -> torch.nn.Module:
    """The HF model of directory ``d`` (its weights from the tensorizer file ``tensors`` when given)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if tensors:
        from tensorizer import TensorDeserializer

        cfg = LlamaConfig.from_pretrained(d)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        with TensorDeserializer(tensors, device="cpu", verify_hash=True) as t:
            sd = {k: v.clone() for k, v in t.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.tie_weights()
            missing = [k for k in missing if k != "lm_head.weight"]
        assert not missing and not unexpected, (missing, unexpected)
        # non-persistent buffers (rotary inv_freq) live on meta: rebuild them
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        assert type(model).__name__ == AutoConfig.from_pretrained(d).architectures[0], type(model)
    return model


def write_logits(model: torch.nn.Module, seq: int, path: str) -> None:
    model.eval()
    with torch.no_grad():
        out = model(tokens(model.config.vocab_size, seq)).logits.float().contiguous()
    with open(path, "wb") as f:
        f.write(out.numpy().tobytes())
    with open(path + ".json", "w") as f:
        json.dump(list(out.shape), f)


if __name__ == "__main__":
    sys.exit(main())
