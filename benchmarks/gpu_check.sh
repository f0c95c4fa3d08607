#!/usr/bin/env bash
# The checks gradsync runs on a GPU machine, in one go (docs/gpu.md records what they gave).
#
#   benchmarks/gpu_check.sh OUTDIR [GPU_SECONDS]
#   CHECKS="examples" benchmarks/gpu_check.sh OUTDIR     # some of: parity nccl examples bench
#
# 1. The parity and loop-feature tests with their models on CUDA, ranks sharing the GPUs over
#    Gloo (GRADSYNC_BACKEND=gloo): every strategy (hybrid with its tables on the servers too),
#    tensors staged through host memory.
# 2. The same tests on NCCL, one rank per GPU (the cases that fit the GPUs there are).
# 3. The example under `gradsync run` on NCCL, one rank per GPU: bf16 autocast under every strategy
#    that runs without servers there, fp16 with a GradScaler and clipping under allreduce and ddp, and
#    the clear errors for a GradScaler under p3 and for more ranks than GPUs.
# 4. `allreduce` next to `ddp` on the CPUs (CUDA hidden) with a core per rank: vgg19:tiny, 4 workers
#    (three runs on loopback; three on the shaped links where `ip` and `tc` run: carry them in
#    .ipr/, made by benchmarks/carry_iproute2.sh, where the machine has no iproute2).
# Each step has its own time limit; logs go to OUTDIR (at most 8 files).
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR [GPU_SECONDS]}
budget=${2:-170}
checks=${CHECKS:-parity nccl examples bench}
want() { [[ " $checks " == *" $1 "* ]]; }
mkdir -p "$out"
[ -x .ipr/bin/ip ] && export PATH=$PWD/.ipr/bin:$PATH  # iproute2 carried by benchmarks/carry_iproute2.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! command -v gradsync >/dev/null; then  # no install: a shim over the checkout
    mkdir -p /tmp/gradsync-bin
    printf '#!/bin/sh\nexec python3 -c "import sys; from gradsync.cli import main; sys.exit(main())" "$@"\n' \
        > /tmp/gradsync-bin/gradsync
    chmod +x /tmp/gradsync-bin/gradsync
    export PATH=/tmp/gradsync-bin:$PATH
fi
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
step() {  # step NAME SECONDS COMMAND...: run, log, one summary line
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >> "$out/$name.log" 2>&1
    local rc=$?
    echo "$name: rc $rc in $((SECONDS - t0)) s: $*" | tee -a "$out/summary.txt"
}
{
    date -u; nproc; free -g | head -2; nvidia-smi -L
    python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
        'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
    command -v ip tc || echo "no ip/tc here"
} > "$out/info.log" 2>&1
cat "$out/info.log"

tests="tests/test_parity.py::test_matches_single_process_reference
       tests/test_parity.py::test_strategies_on_hosts_of_several_workers_match_the_reference
       tests/test_user_loop.py::test_loop_features_match_the_single_process_reference
       tests/test_hybrid.py::test_language_model_matches_reference
       tests/test_hybrid.py::test_recommendation_model_splits_its_tables
       tests/test_compress.py::test_every_codec_runs_on_the_gradients_device_as_on_the_cpu"
# 1. Gloo, CUDA tensors, ranks sharing the GPUs (hosts of several ranks too: the two-level paths).
want parity && step gloo_cuda "$budget" env GRADSYNC_TEST_DEVICE=cuda GRADSYNC_BACKEND=gloo \
    python3 -m pytest -q -p no:cacheprovider -n 8 $tests \
    tests/test_user_loop.py::test_a_gradscaler_under_a_strategy_that_sent_the_scaled_gradients_is_an_error
# 2. NCCL: the cases with no more ranks than GPUs (one worker, one rank, on one GPU).
if [ "$gpus" -ge 2 ]; then select="w1 or w2-s0"; else select="w1-s0"; fi
want nccl && step nccl 90 env GRADSYNC_TEST_DEVICE=cuda \
    python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_parity.py::test_matches_single_process_reference -k "$select"
# 3. The example on NCCL, and more ranks than GPUs.
if want examples; then
    for s in allreduce ddp casync-ring casync-ps compressed-allgather sma p3 ps-sliced allreduce-priority ps; do
        step example 40 gradsync run -np "$gpus" -- python3 examples/train.py --device cuda --amp --strategy "$s" --steps 20
    done
    for s in allreduce ddp; do
        step example 40 gradsync run -np "$gpus" -- python3 examples/train.py --device cuda --amp fp16 --clip 1.0 \
            --strategy "$s" --steps 20
    done
    step refused 40 gradsync run -np "$gpus" -- python3 examples/train.py --device cuda --amp fp16 --strategy p3 --steps 3
    step refused 40 gradsync run -np $((gpus + 1)) -- python3 examples/train.py --device cuda --steps 2
fi
# 4. allreduce next to ddp, a core per rank, CUDA hidden (Gloo on the CPUs).
want bench && for run in 1 2 3; do
    step bench 70 env CUDA_VISIBLE_DEVICES= gradsync bench --model vgg19:tiny --strategies allreduce,ddp --np 4 \
        --check-steps 0 --rounds 9 --steps 90
done
if want bench && command -v ip >/dev/null && command -v tc >/dev/null; then
    for run in 1 2 3; do
        step bench 100 env CUDA_VISIBLE_DEVICES= gradsync bench --model vgg19:tiny --strategies allreduce,ddp --np 4 \
            --net 1gbit,10gbit --check-steps 0 --rounds 9 --steps 90
    done
fi
cat "$out/summary.txt"
