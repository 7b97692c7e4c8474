#!/bin/bash
# Issue 45's checks on a lent GPU machine, as one prepared run (each step's log into $OUT):
#   1. GPTQ's Triton inner block against the CPU's arithmetic, and whole GPTQ on the GPU against the CPU's;
#   2. GPTQ W4A16 on a random Llama with Llama-3-8B's layer shapes, llmpress against llm-compressor;
#   3. two ranks on the GPU against one process (perplexity within 0.1%);
#   4. LlmpressTrainer with FSDP2 on the GPU, pruning to 50%, saved and reloaded.
# The machine has torch, transformers and triton; llm-compressor, compressed-tensors, pydantic and
# the peers' other needs travel as wheels in .whl (see bench/README.md, "On a GPU").
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${BUDGET_S:-560}))
# into the machine's own environment: the benchmark's llm-compressor process runs with no PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/0-machine.log"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/0-machine.log"

step() {  # step NAME SECONDS COMMAND...: run with a timeout cut to the time left
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "== $name: not run (no time left)" | tee -a "$OUT/summary.log"; return; fi
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/summary.log"
  tail -n 25 "$OUT/$name.log"
}

step 1-kernel 120 python3 -m pytest -q -p no:cacheprovider -s tests/native/test_gptq_native.py -k "gpu"
step 2-gptq-8b-layers 300 env LLMPRESS_PEER_PYTHON="$(which python3)" python3 bench/gptq.py --models llama3-8b-layers \
  --bits 4 --repeat 1 --repeat-large 1 --work /tmp/bench
step 3-gpu-ranks 150 python3 -m pytest -q -p no:cacheprovider -s tests/parallel/test_gpu_ranks.py -k "gpu"
step 4-trainer-fsdp 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 examples/prune_with_trainer.py --fsdp \
  --model assets/tiny-llama --text assets/text/calibration.txt --output /tmp/fsdp-out --max-samples 64 --max-windows 20
exit 0
