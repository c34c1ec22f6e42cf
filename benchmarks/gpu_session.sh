#!/usr/bin/env bash
# One GPU, one short session: the kernel tables of the dynamic blocks and benchmarks/gpu_check.py.
#
# Produces the GPU reports in docs/gpu/ (summarized in docs/gpu.md):
#   bash benchmarks/gpu_session.sh OUT [GROUPS]
# OUT gets few files (what a lent machine sends back): session.txt (device, torch, each step's
# exit status and time), blocks.md (bench_dynamic_blocks.py --device cuda: MoE grouped and padded
# against dense, Mixture of Depths per capacity), hashattn.md (bench_hashattn.py --device cuda:
# FlexAttention against SDPA), check-<group>.md (gpu_check.py's report per group of cases) and
# checks.tar.gz (every group's report.json and console log). The run folders stay in WORK
# (default /tmp/gpu-session).
# GROUPS (default all but the compiled ones): comma-separated from core, shrink, long, blocks,
# hashattn, staged, compiled, long-compiled (the last two: gpu_check --compile), cudagraphs
# (gpu_check --cuda-graphs: the compiled units replayed as CUDA graphs), compile-check
# (compile_check.py, inductor: every block kind compiled through the launcher against eager,
# compile-check.md), profile (profile_step.py: where a step's time goes, device busy against
# wall, for dense, MoD and MoE, with and without dynmo's per-layer marks, profile.md), hostops
# (every block kind's kernel launches per step beside its tokens/s, eager and compiled, from
# profile_step.py at gpu_check's size, after host_ops.py's exact operator counts; hostops.md).
# Each step has a time limit of its own, so a slow one cannot take the others' time.
set -u
OUT=${1:?usage: bash benchmarks/gpu_session.sh OUT [GROUPS]}
WANT=${2:-core,shrink,long,blocks,hashattn,staged}
WORK=${WORK:-/tmp/gpu-session}
mkdir -p "$OUT" "$WORK"
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  git rev-parse --short HEAD 2>/dev/null || true
} >"$OUT/session.txt" 2>&1
cat "$OUT/session.txt"

step() {  # step SECONDS NAME COMMAND...: run with a limit, log the exit status
  local limit=$1 name=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@"
  echo "== $name: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/session.txt"
}

check() {  # check SECONDS GROUP CASES STAGINGS [gpu_check options]
  local limit=$1 group=$2 cases=$3 stagings=$4
  shift 4
  step "$limit" "check-$group" python3 benchmarks/gpu_check.py --out "$WORK/check-$group" --cases "$cases" \
    --stagings "$stagings" "$@" >"$WORK/check-$group.log" 2>&1
  tail -3 "$WORK/check-$group.log"
  cp "$WORK/check-$group/report.md" "$OUT/check-$group.md" 2>/dev/null
  (cd "$WORK" && tar czf "$OUT/checks.tar.gz" check-*.log check-*/report.json 2>/dev/null)
}

for g in ${WANT//,/ }; do
  case $g in
    blocks)
      step 60 blocks python3 benchmarks/bench_dynamic_blocks.py --device cuda --dtype bf16 --cases moe,mod \
        --d-model 2048 --seq-len 2048 --batch 4 --repeats 5 >"$OUT/blocks.md" 2>&1
      tail -30 "$OUT/blocks.md" ;;
    hashattn)
      step 100 hashattn python3 benchmarks/bench_hashattn.py --device cuda --dtype bf16 --paths flex \
        --heads 16 --seqs 8192 --buckets 1,2,4,8,16 --repeats 3 >"$OUT/hashattn.md" 2>&1
      tail -10 "$OUT/hashattn.md" ;;
    core) check 150 core gpt-dense,llama-dense,gpt-moe,mixtral-moe,gpt-mod,llama-mod 1stage ;;
    shrink) check 60 shrink gpt-freezing,llama-freezing 1stage ;;
    long) check 150 long gpt-hashattn-8k,gpt-dense-8k,gpt-hashattn-16k,gpt-dense-16k 1stage ;;
    staged) check 120 staged gpt-moe,gpt-hashattn,gpt-mod 2stage ;;
    compiled) check 170 compiled gpt-dense,gpt-mod,gpt-moe 1stage --compile ;;
    long-compiled) check 120 long-compiled gpt-hashattn-8k,gpt-dense-8k 1stage --compile ;;
    cudagraphs) check 200 cudagraphs gpt-dense,gpt-mod,gpt-moe,llama-mod 1stage --cuda-graphs ;;
    compile-check)
      step 240 compile-check python3 benchmarks/compile_check.py --backend inductor --steps 4 \
        >"$OUT/compile-check.md" 2>&1
      cat "$OUT/compile-check.md" ;;
    profile)
      step 150 profile sh -c 'python3 benchmarks/profile_step.py --cases gpt-dense,gpt-mod,gpt-moe,llama-mod \
        && python3 benchmarks/profile_step.py --cases gpt-dense,gpt-mod --no-marks --top 0' >"$OUT/profile.md" 2>&1
      grep "^| " "$OUT/profile.md" | head -12 ;;
    hostops)
      step 240 hostops sh -c 'python3 benchmarks/host_ops.py \
        && python3 benchmarks/profile_step.py --cases gpt-dense,gpt-mod,gpt-moe,llama-dense,mixtral-moe,llama-mod --top 0 \
        && python3 benchmarks/profile_step.py --cases gpt-dense,gpt-mod,gpt-moe,llama-dense,mixtral-moe,llama-mod --top 0 \
           --compile' >"$OUT/hostops.md" 2>&1
      grep -E "^\| |^[a-z-]+ +[0-9]" "$OUT/hostops.md" | head -30 ;;
    *) echo "unknown group $g" >&2; exit 2 ;;
  esac
done
tail -8 "$OUT/session.txt"
