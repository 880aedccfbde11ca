"""transformers' loss on token batches, in its own process (see hf_logits.py for why)::

    python hf_loss.py OUT DIR TOKENS [DIR TOKENS ...]

TOKENS is raw int64 ``[batch, seq + 1]`` with a ``.json`` shape file beside it. For each pair, the mean
next-token cross entropy of ``TOKENS[:, :-1]`` against ``TOKENS[:, 1:]``, every token counted: what
``examples/pretrain_gpt.py`` reports as its loss. OUT gets the losses as a JSON list.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import torch


def main() -> int:
    out, pairs = sys.argv[1], sys.argv[2:]
    from transformers import AutoModelForCausalLM

    losses = []
    for d, tokens in zip(pairs[::2], pairs[1::2]):
        seqs = torch.from_numpy(np.fromfile(tokens, dtype=np.int64).reshape(json.load(open(tokens + ".json"))))
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(seqs[:, :-1]).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                        seqs[:, 1:].reshape(-1)).item())
    with open(out, "w") as f:
        json.dump(losses, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
