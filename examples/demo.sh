#!/usr/bin/env bash
# megashard + Megatron demo, on CPU (gloo) with 2 processes, in well under two minutes:
#   run 1: train a tiny GPT with TP=2, checkpoint every 2 iterations, stop at iteration 4
#   run 2: resume from the latest checkpoint (same layout), stop at iteration 8
#   run 3: resume from the latest checkpoint with another layout, TP=1 x DP=2, up to 12
#   then:  an uninterrupted 12-iteration TP=2 run, and a loss-by-loss comparison.
# Usage: bash examples/demo.sh        (PYTHON=/path/to/python to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/megashard-demo.XXXXXX")
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
PORT=$((29500 + RANDOM % 1000))

run() {  # run <log> <args...>
  local log=$1; shift
  "$PYTHON" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$PORT" \
    examples/pretrain_gpt.py --train-iters 12 --lr-decay-iters 12 --save-format tensors "$@" 2>&1 \
    | tee "$WORK/$log" | grep -E "^(layout|started|iteration|saved|exiting)" || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED, see $WORK/$log"; exit 1; }
}

CKPT="$WORK/checkpoints"
echo "### run 1: TP=2 from scratch, saving every 2 iterations into $CKPT, stopping at 4"
run run1.log --tensor-model-parallel-size 2 --save "$CKPT" --load "$CKPT" --save-interval 2 --exit-interval 4
echo
echo "### run 2: resume from the latest checkpoint, same layout (TP=2), stopping at 8"
run run2.log --tensor-model-parallel-size 2 --save "$CKPT" --load "$CKPT" --save-interval 2 --exit-interval 8
echo
echo "### run 3: resume from the latest checkpoint with TP=1 x DP=2, up to 12"
run run3.log --tensor-model-parallel-size 1 --save "$CKPT" --load "$CKPT" --save-interval 2
echo
echo "### reference: the same 12 iterations, uninterrupted, TP=2, no checkpoints"
run ref.log --tensor-model-parallel-size 2 > /dev/null
echo "checkpoints:"; ls "$CKPT"; echo "tracker: $(cat "$CKPT/latest_checkpointed_iteration.txt")"
echo
"$PYTHON" - "$WORK" <<'PY'
import re, sys, os
work = sys.argv[1]
def losses(name):
    out = {}
    for line in open(os.path.join(work, name)):
        m = re.match(r"iteration (\d+) \| loss (\S+)", line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out
resumed = {**losses("run1.log"), **losses("run2.log"), **losses("run3.log")}
ref = losses("ref.log")
print(f"{'iter':>4}  {'run':<13} {'resumed loss':>20} {'uninterrupted':>20} {'|diff|':>9}")
for it in sorted(ref):
    run = "1 (TP2)" if it <= 4 else "2 (TP2)" if it <= 8 else "3 (TP1 DP2)"
    d = abs(resumed[it] - ref[it])
    print(f"{it:>4}  {run:<13} {resumed[it]!r:>20} {ref[it]!r:>20} {d:>9.2e}")
same = all(resumed[i] == ref[i] for i in ref if i <= 8)
worst = max(abs(resumed[i] - ref[i]) for i in ref if i > 8)
print(f"\nsame-layout resume bit-exact: {same}; after the layout change max |diff| = {worst:.2e}")
PY
echo "(logs and checkpoints in $WORK)"
