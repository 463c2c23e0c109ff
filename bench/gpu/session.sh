#!/usr/bin/env bash
# On the GPU machine (the device tool's working tree), after bench/gpu/prepare.sh here:
#   bash bench/gpu/session.sh CASE [CASE...]      results under $OUT/<case>/, logs tarred
# Cases (each a bench script with the time budget of one call):
#   tiny      bench/cuda_target.py cold,keepkernels,edit,stock,cold4w,layer with warm processes on (CUDABUILD_WARM=1)
#   tinycold  bench/cuda_target.py cold,keepkernels,stock with them off: the same figures the old way
#   qwen      bench/qwen_moe_cuda.py cold,stock (ExecuTorch's Qwen3.5-MoE, tiny)
#   qwenwarm  the same with warm processes on
#   weights   bench/new_weights.py tiny_lm: another seed against a cold build of it (issue 46)
#   qwenweights  the same for qwen_moe tiny (its quantize stage reruns, by design)
#   tests     the GPU tests of the cuda target
#   real      bench/qwen_moe_real.py: the whole build at size=35b-a3b layers=$LAYERS (default 8), low_memory_mode ON,
#             as on a card of $CAP (default 24GiB: CUDABUILD_DEVICE_MEMORY) and, with HOSTMEM (64GiB), a host of
#             that size (CUDABUILD_HOST_MEMORY); with CGROUP_MAX (56G) inside a cgroup of that memory.max where the
#             machine lets one be made; then a no-op and a restore, and with NEWSEED=N a build of seed N;
#             per-stage seconds and peaks; disk, host memory in use and the card's NVML use, sampled every second
#   side      bench/qwen_moe_side_by_side.py: cudabuild cold against the stock exporter at 35b-a3b layers=$LAYERS (8)
#   envelope  bench/qwen_moe_envelope.py: the references alone at 35b-a3b layers=$LAYERS (8): how far bf16 strays
#             from the fp32 truth, per step; TOKENS=prefill=T0,T1 places a compiled build's picks among the truth's logits
#   realtest  the GPU test at the real shapes (tests/gpu, -k real_shapes)
#   quant40   bench/quantize_full.py: the quantize stage alone at size=35b-a3b, all 40 layers, min/max then HQQ
#   driver    which warm imports map or initialise the CUDA driver (bench/gpu/driver_probe.py)
#   truth     bench/qwen_moe_truth.py: at size=35b-a3b layers=$LAYERS (default 4), the compiled methods
#             and bf16 eager each against an fp32 eager truth of the same int4 weights
# BUDGET (seconds, default 540) bounds the cases' own budgets; the call's limit is 600 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-540}
if [ ! -d /tmp/site/executorch ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "session: the wheels did not install"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export CUDABUILD_KERNEL_CACHE=${CUDABUILD_KERNEL_CACHE:-/tmp/cb-kernels}
export PATH=/tmp/site/bin:$PATH
# A call returns at most 8 files: cases.txt, then per case its results' JSON and one tarball.
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  python3 -c "import importlib.metadata as m, torch, triton; print(torch.__version__, m.version(\"executorch\"), triton.__version__)"
} > "$OUT/cases.txt" 2>&1
# Run a command inside a fresh cgroup (v2) whose memory.max is $1, where the machine lets one be made
# (a real limit on the build's host memory); else as it is. Says which in cases.txt.
in_cgroup() {
  local max=$1; shift
  if [ -n "$max" ]; then
    local cg=/sys/fs/cgroup/cudabuild-$$
    if mkdir -p "$cg" 2>/dev/null && echo "$max" > "$cg/memory.max" 2>/dev/null && echo $BASHPID > "$cg/cgroup.procs" 2>/dev/null; then
      echo "cgroup: $cg memory.max=$(cat "$cg/memory.max")" >> "$OUT/cases.txt"
    else
      echo "cgroup: none could be made here (memory.max=$max not applied)" >> "$OUT/cases.txt"
    fi
  fi
  "$@"
}
started=$(date +%s)
for case in "$@"; do
  left=$((BUDGET - ($(date +%s) - started)))
  dir="$OUT/$case"; mkdir -p "$dir"
  case $case in
    tiny)     CUDABUILD_WARM=1 python3 bench/cuda_target.py --cases cold,keepkernels,edit,stock,cold4w,layer --budget "$left" --out "$dir/r" ;;
    tinycold) CUDABUILD_WARM=0 python3 bench/cuda_target.py --cases cold,keepkernels,stock --budget "$left" --out "$dir/r" ;;
    qwen)     python3 bench/qwen_moe_cuda.py --cases cold,stock --budget "$left" --out "$dir/r" ;;
    qwenwarm) CUDABUILD_WARM=1 python3 bench/qwen_moe_cuda.py --cases cold,stock --budget "$left" --out "$dir/r" ;;
    weights)  timeout "$left" python3 bench/new_weights.py --target cuda --models tiny_lm --no-shared --out "$dir/r" ;;
    qwenweights) timeout "$left" python3 bench/new_weights.py --target cuda --models qwen_moe --no-shared --out "$dir/r" ;;
    tests)    timeout "$left" python3 -m pytest -q tests/gpu -x ;;
    truth)    python3 bench/qwen_moe_truth.py --layers "${LAYERS:-4}" --budget "$left" --out "$dir/r" ;;
    real)     CUDABUILD_DEVICE_MEMORY=${CAP-24GiB} CUDABUILD_HOST_MEMORY=${HOSTMEM-} in_cgroup "${CGROUP_MAX-}" \
                python3 bench/qwen_moe_real.py --layers "${LAYERS:-8}" --budget "$left" --out "$dir/r" ${NEWSEED:+--new-seed "$NEWSEED"} ;;
    side)     python3 bench/qwen_moe_side_by_side.py --layers "${LAYERS:-8}" --budget "$left" --out "$dir/r" ;;
    envelope) python3 bench/qwen_moe_envelope.py --layers "${LAYERS:-8}" --budget "$left" --out "$dir/r" ${TOKENS:+--tokens "$TOKENS"} ;;
    realtest) timeout "$left" python3 -m pytest -q tests/gpu -k real_shapes -x ;;
    quant40)  python3 bench/quantize_full.py --layers "${LAYERS:-0}" --budget "$left" --out "$dir/r" ;;
    driver)   python3 bench/gpu/driver_probe.py --target cuda --who && cp "$dir/stdout.txt" "$OUT/driver.txt" ;;
    *)        echo "session: unknown case $case"; continue ;;
  esac > "$dir/stdout.txt" 2>&1
  echo "$case: rc=$? after $(( $(date +%s) - started )) s" | tee -a "$OUT/cases.txt"
  [ -f "$dir/r/cuda_target.json" ] && cp "$dir/r/cuda_target.json" "$OUT/$case.json"
  [ -f "$dir/r/qwen_moe_cuda.json" ] && cp "$dir/r/qwen_moe_cuda.json" "$OUT/$case.json"
  [ -f "$dir/r/qwen_moe_truth.json" ] && cp "$dir/r/qwen_moe_truth.json" "$OUT/$case.json"
  [ -f "$dir/r/quantize_full.json" ] && cp "$dir/r/quantize_full.json" "$OUT/$case.json"
  [ -f "$dir/r/qwen_moe_real.json" ] && cp "$dir/r/qwen_moe_real.json" "$OUT/$case.json"
  [ -f "$dir/r/qwen_moe_side_by_side.json" ] && cp "$dir/r/qwen_moe_side_by_side.json" "$OUT/$case.json"
  [ -f "$dir/r/qwen_moe_envelope.json" ] && cp "$dir/r/qwen_moe_envelope.json" "$OUT/$case.json"
  [ -f "$dir/r/new_weights.json" ] && cp "$dir/r/new_weights.json" "$OUT/$case.json"
  grep -h "CPU ISA probe\|warm:" "$dir"/r/logs-*/*.log /tmp/cudabuild-warm-*/*.log 2>/dev/null | sort | uniq -c > "$dir/probes.txt"
  mkdir -p "$dir/warm" && cp /tmp/cudabuild-warm-*/*.log "$dir/warm/" 2>/dev/null
  tar -C "$OUT" -czf "$OUT/$case.tgz" "$case" && rm -rf "$dir"
done
ls -la "$OUT"
