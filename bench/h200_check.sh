#!/bin/bash
# One device call's worth of GPU checks, from the repo root on the H200 (see env README: the
# device's python needs the wheels built by ../shared/tools/device-wheels.sh, carried as .whl/).
#
#   bash bench/h200_check.sh tests     # gpu-marked kernel tests, model decode tests      (~8 min)
#   bash bench/h200_check.sh queued    # queued decode passes, device sampling (model tests) (~5 min)
#   bash bench/h200_check.sh oracle    # model tests against llama.cpp's logits            (~6 min)
#   bash bench/h200_check.sh kernels   # kernel micro-benchmarks                          (~3 min)
#   bash bench/h200_check.sh gemm      # GEMM / attention / intrinsics kernel tests, model tests
#                                      # on tensor cores against llama.cpp, 32/64-token linears,
#                                      # prefill GEMM rates, decode attention           (~7 min)
#   bash bench/h200_check.sh profile   # CUPTI per-kernel profiles: batch 1, batch 64, prefill,
#                                      # then the host side of a decode step               (~7 min)
#   bash bench/h200_check.sh bench36   # `sparkinfer bench`, Qwen3.6 shape: 512 / 32768 tokens,
#                                      # 8 / 64 sequences (~6.5 min: ~4 of them compiling kernels)
#   bash bench/h200_check.sh bench30   # `sparkinfer bench`, Qwen3-30B shape, 512 / 32768 tokens
#                                      # (~2.5 min)
#   bash bench/h200_check.sh trace30   # every launch of a Qwen3-30B decode step after 512 tokens
#                                      # (CUPTI, in order), then its host side       (~2 min)
#   bash bench/h200_check.sh moe       # MoE-model GPU tests (exact decode, batched, q8 top-1), a
#                                      # Qwen3-30B step's trace, `sparkinfer bench` after 512 (~7 min)
#   BASE=oldtree bash bench/h200_check.sh ab30
#                                      # `sparkinfer bench`, Qwen3-30B after 512 tokens, for the
#                                      # trees in $BASE (space-separated), then this one, on the
#                                      # same machine (a baseline beside each candidate). Make
#                                      # them here first, then carry them (ignored: /oldtree/):
#                                      # mkdir oldtree && git archive <commit> sparkinfer_cli |
#                                      # tar -x -C oldtree (more trees: oldtree/<name>); carry
#                                      # [".whl", "oldtree"]                 (~1.5 min a tree)
#   bash bench/h200_check.sh pdl       # `sparkinfer bench`, Qwen3-30B after 512 tokens, chained
#                                      # launches off then on; graph and exact-decode GPU tests
#                                      # (~7 min)
#
# Everything is logged under $OUT (the device tool brings that folder back).
set -u
case "${1:-tests}" in
  tests|queued|oracle|kernels|gemm|profile|bench36|bench30|trace30|pdl|moe|ab30) ;;
  *) echo "usage: $0 tests|queued|oracle|kernels|gemm|profile|bench36|bench30|trace30|pdl|moe|ab30" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
S=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$S" .whl/*.whl
# unbuffered: a run cut by `timeout` keeps what it printed
export PYTHONPATH=$S:$PWD NUMBA_ENABLE_CUDASIM=0 PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1

run() {  # run LOG TIMEOUT CMD...: log to $OUT/LOG, print its tail
  local log=$1 limit=$2
  shift 2
  # SIGINT first: python prints where it was (KeyboardInterrupt traceback); KILL 15 s later
  timeout -s INT -k 15 "$limit" "$@" > "$OUT/$log" 2>&1
  echo "== $log (exit $?)"
  tail -n 12 "$OUT/$log"
}

case "${1:-tests}" in
  tests)  # the model file takes > 300 s cold: its decode half here, the oracle half below
    run gpu_kernels.log 230 python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider
    run gpu_model.log 330 python3 -m pytest -m gpu tests/backend/cuda/test_cuda_model.py \
      -k "(exact_decode and (Q4_K_M or F32)) or greedy_ids or batched" \
      -q -p no:cacheprovider ;;
  queued)  # queued decode passes and device sampling against step-by-step / host
    run gpu_queued.log 500 python3 -m pytest -m gpu tests/backend/cuda/test_cuda_model.py \
      -k "queued_decode or forward_sampled" -q -p no:cacheprovider ;;
  oracle)
    run gpu_oracle.log 500 python3 -m pytest -m gpu tests/backend/cuda/test_cuda_model.py \
      -k "not (demo_model or decode or greedy or batched or sampled)" -q \
      -p no:cacheprovider ;;
  kernels)
    for b in cuda_mma_bench cuda_attention_bench cuda_decode_attention_bench cuda_delta_bench \
        cuda_gemv_bench; do
      run "$b.log" 70 python3 "bench/probes/$b.py"
    done ;;
  gemm)
    run gpu_gemm.log 200 python3 -m pytest -m gpu tests/kernels/test_cuda_mmq_q8.py \
      tests/kernels/test_cuda_mma_gemm.py tests/kernels/test_cuda_attention.py \
      tests/kernels/test_cuda_embedding.py -q -p no:cacheprovider
    run gpu_model_tc.log 240 python3 -m pytest -m gpu tests/backend/cuda/test_cuda_model.py \
      -k "tensor_cores_in_a_batched or (q8_top1 and True) or batched_decode_equals" \
      -q -p no:cacheprovider
    run gemv_batch.log 100 python3 bench/probes/cuda_gemv_bench.py --batch-only
    run mma.log 100 python3 bench/probes/cuda_mma_bench.py
    run decode_attention.log 100 python3 bench/probes/cuda_decode_attention_bench.py --heads 0 ;;
  profile)
    P=bench/probes/cuda_kernel_profile.py
    run prof_b1.log 150 python3 $P qwen3.6-35b-a3b "$OUT/prof_b1.json" --steps 10 --trace
    run prof_b64.log 150 python3 $P qwen3.6-35b-a3b "$OUT/prof_b64.json" --steps 5 --batch 64 --ctx 128
    run prof_pf.log 120 python3 $P qwen3.6-35b-a3b "$OUT/prof_pf.json" --steps 2 --prefill 4096 --ctx 0
    run host_b1.log 120 python3 bench/probes/cuda_host_profile.py qwen3.6-35b-a3b ;;
  bench36)
    run bench36.log 560 python3 -m sparkinfer_cli bench --synthetic qwen3.6-35b-a3b --device cuda \
      --ctx 512 --ctx 32768 --concurrency 8 --concurrency 64 --out "$OUT/bench" ;;
  bench30)
    run bench30.log 560 python3 -m sparkinfer_cli bench --synthetic qwen3-30b-a3b --device cuda \
      --ctx 512 --ctx 32768 --concurrency 1 --out "$OUT/bench" ;;
  pdl)  # programmatic dependent launches (SPARKINFER_CUDA_PDL) off, then on
    for on in 0 1; do
      export SPARKINFER_CUDA_PDL=$on; run "bench30_pdl$on.log" 200 python3 -m sparkinfer_cli bench \
        --synthetic qwen3-30b-a3b --device cuda --ctx 512 --concurrency 1 --out "$OUT/bench_pdl$on"
    done
    run gpu_pdl_tests.log 200 python3 -m pytest -m gpu tests/kernels/test_cuda_graphs.py \
      tests/backend/cuda/test_cuda_model.py -k "graphs or (exact_decode and Q4_K_M) or batched_decode_equals" \
      -q -p no:cacheprovider ;;
  moe)
    run gpu_moe.log 260 python3 -m pytest -m gpu tests/backend/cuda/test_cuda_model.py \
      -k "moe and (exact_decode or batched_decode or q8_top1 or greedy_ids)" -q -p no:cacheprovider
    run trace30.log 150 python3 bench/probes/cuda_kernel_profile.py qwen3-30b-a3b "$OUT/trace30.json" \
      --steps 10 --trace
    run bench30.log 150 python3 -m sparkinfer_cli bench --synthetic qwen3-30b-a3b --device cuda \
      --ctx 512 --concurrency 1 --out "$OUT/bench" ;;
  ab30)  # baseline trees and this one, on one machine
    for tree in ${BASE:-}; do  # BASE: one or more folders, each holding a sparkinfer_cli
      [ -d "$tree/sparkinfer_cli" ] || { echo "BASE=<folders holding sparkinfer_cli>" >&2; exit 2; }
    done
    # each from inside its tree: `python3 -m` imports the current directory's package first,
    # whatever PYTHONPATH says
    for tree in ${BASE:-} .; do
      (cd "$tree" && name=$(basename "$PWD") && PYTHONPATH=$S:$PWD && \
        python3 -c "import sparkinfer_cli; print('imported', sparkinfer_cli.__file__)" && \
        run "bench30_$name.log" 150 python3 -m sparkinfer_cli bench --synthetic qwen3-30b-a3b \
          --device cuda --ctx 512 --concurrency 1 --out "$OUT/bench_$name")
    done ;;
  trace30)
    run trace30.log 200 python3 bench/probes/cuda_kernel_profile.py qwen3-30b-a3b "$OUT/trace30.json" \
      --steps 10 --trace
    run host30.log 150 python3 bench/probes/cuda_host_profile.py qwen3-30b-a3b ;;
esac
