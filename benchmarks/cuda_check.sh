#!/usr/bin/env bash
# tokenmill on a CUDA machine, in one run (CI has no GPU; this is how a lent GPU is used).
#
# 1. The engine and model tests with every LLM on the GPU (TOKENMILL_TEST_DEVICE=cuda) against the
#    transformers references on the CPU: greedy tokens, logprobs, chunked prefill, preemption,
#    prefix caching, Gemma 3, MoE, the transformers fallback.
# 2. Offline throughput, tokenmill vs transformers, both on the GPU, with a SmolLM2-135M-shaped model
#    of random weights (the real GGUF is too large to carry there; the shape sets the speed).
#
# Expects, in the repository root: .whl/ (wheels of the pure-Python packages the GPU image lacks:
# gguf, msgspec) and .gpu/smollm2-shape/ (the bundled model's config and tokenizer files).
# Writes logs under $OUT (default /tmp/tokenmill-cuda-check).
set -u
OUT=${OUT:-/tmp/tokenmill-cuda-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

TOKENMILL_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/models/test_llama_family.py tests/unit/test_engine_behaviour.py tests/unit/test_sampler.py \
    tests/unit/test_prefix_cache_engine.py tests/models/test_gemma3.py tests/models/test_moe.py \
    tests/models/test_transformers_fallback.py tests/models/test_sliding_window.py \
    >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -30

python3 - <<'EOF'
import shutil
import torch
import transformers

config = transformers.AutoConfig.from_pretrained(".gpu/smollm2-shape")
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained("/tmp/smollm2-shape")
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".gpu/smollm2-shape/{name}", "/tmp/smollm2-shape")
print("random-weight SmolLM2-135M shape saved")
EOF
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/offline_throughput.py --model /tmp/smollm2-shape --device cuda \
    --num-prompts 256 --max-num-seqs 256 --hf-batch-size 256 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
