#!/usr/bin/env bash
# The learner's GPU figures in one run, for a GPU machine that reaches no registry (docs/scale.md, docs/benchmarks.md).
# Prepare on this machine, then run this on the GPU one with .whl carried along:
#   EXTRA="torchao==0.18.0" ../shared/gpu/wheels.sh .venv KINDS.md        # fills .whl/ (git-ignored)
#   bench/gpu_learner.sh [figures|scale|compile]    # on the GPU machine; writes $OUT or bench/out/gpu
# figures (default, ~9 min): the two step-time figures against TRL, flex attention, the gpu tests.
# scale (~8 min): what one GPU holds: a 64k-token micro-batch, Qwen3-8B's shape with 8-bit moments.
# compile (~4 min): the 16 x 8 figure with --compile, against TRL (its compile time in echo2_compile_s).
# Each step is bounded by `timeout` and writes its own file, so a step that fails or runs out of time leaves the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out/gpu}"
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$out/install.txt" 2>&1
    export PYTHONPATH="/tmp/site:$PWD"
fi
export USE_HUB_KERNELS=NO ECHO2_CACHE="${ECHO2_CACHE:-/tmp/echo2-cache}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
bench() {  # bench NAME SECONDS ARGS...: one bench/learner.py run, its JSON in NAME.json, its log in NAME.err
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" python3 bench/learner.py --device cuda --json "$@" > "$out/$name.json" 2> "$out/$name.err"
    echo "$name: rc $? $(head -c 400 "$out/$name.json")"
}
if [ "${1:-figures}" = figures ]; then
    # 4 x 8 and 16 x 8 completions of up to 512 tokens, Qwen3-0.6B's shape, against TRL.
    bench p4 150 --shape qwen3-0.6b --prompts 4 --n 8 --completion-len 512 --repeats 3
    bench p16 180 --shape qwen3-0.6b --prompts 16 --n 8 --completion-len 512 --repeats 3
    bench p16-flex 120 --shape qwen3-0.6b --prompts 16 --n 8 --completion-len 512 --repeats 3 --attention flex_attention --no-trl
    timeout 90 python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/ > "$out/gpu_tests.txt" 2>&1
    echo "gpu tests: rc $? $(tail -1 "$out/gpu_tests.txt")"
elif [ "$1" = compile ]; then
    bench p16-compile 240 --shape qwen3-0.6b --prompts 16 --n 8 --completion-len 512 --repeats 3 --compile
else
    bench p16-mb64k 150 --shape qwen3-0.6b --prompts 16 --n 8 --completion-len 512 --repeats 2 --micro-batch-tokens 65536 --no-trl
    bench 8b-adamw8bit 330 --shape qwen3-8b --prompts 8 --n 8 --completion-len 512 --repeats 2 --optimizer adamw8bit --no-trl
fi
