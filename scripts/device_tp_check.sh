#!/usr/bin/env bash
# Tensor parallelism on a GPU node (NCCL), in one run. Prepared for when a node with two or more
# GPUs is lent; it has not been run yet (the CPU tests run the same code with gloo).
#
# 1. The tensor-parallel tests with every LLM on CUDA (TOKENMILL_TEST_DEVICE=cuda): two ranks on
#    cuda:0 and cuda:1 joined by nccl, greedy tokens equal to transformers' (on the CPU) for the
#    tiny Llama (KV heads split), Mistral (one KV head replicated), Qwen2-MoE and Gemma 3; bfloat16
#    logprobs close to one process; the paused step; the Ray backend with two GPU actors.
# 2. Throughput, one process vs two ranks, on a random-weight SmolLM2-135M-shaped model
#    (benchmarks/tensor_parallel.py --device cuda).
#
# Expects the repository root as the working directory, with tokenmill's dependencies importable
# (see benchmarks/cuda_check.sh for carrying wheels to a bare GPU image) and .gpu/smollm2-shape/
# (the bundled model's config and tokenizer files). Logs go under $OUT (default /tmp/tokenmill-tp).
set -u
OUT=${OUT:-/tmp/tokenmill-tp}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 2 ]; then
    # NCCL refuses two ranks on one device; one GPU can only check the one-rank path.
    echo "only $GPUS GPU(s): tensor parallelism over NCCL needs two; running the one-rank checks"
    TOKENMILL_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfEs \
        tests/models/test_llama_family.py tests/models/test_moe.py >"$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"; tail -5 "$OUT/pytest.log"
    exit 0
fi

TOKENMILL_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/models/test_tensor_parallel.py tests/models/test_ray_executor.py -k "not smollm2" \
    >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -30

python3 - <<'PY'
import torch
import transformers

config = transformers.AutoConfig.from_pretrained(".gpu/smollm2-shape")
config.num_attention_heads, config.num_key_value_heads = 8, 4  # split evenly over 2 or 4 ranks
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained("/tmp/smollm2-shape")
transformers.AutoTokenizer.from_pretrained(".gpu/smollm2-shape").save_pretrained("/tmp/smollm2-shape")
print("random-weight SmolLM2-shaped model saved")
PY
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/tensor_parallel.py --model /tmp/smollm2-shape --device cuda \
    --tp 2 --batch 64 --prompt-len 256 --new 64 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
