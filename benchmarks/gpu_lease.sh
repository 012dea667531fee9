#!/usr/bin/env bash
# One lease of a GPU machine, in one call: the checks the open issues make on a GPU, most valuable
# first, each under its own time limit so that one that hangs leaves the others their time. Logs
# and the profile go to $OUT (the device tool's folder that comes back).
#
#   python benchmarks/gpu_offline.py prepare bench-results/gpu-ckpt   # here: config and tokenizer
#   bash benchmarks/gpu_lease.sh                                       # there (carry .whl, the ckpt)
#
# Wheels in .whl/ (the packages the machine's image lacks) are installed first, when present.
# SKIP="profile offline" leaves those stages out.
set -u
OUT=${OUT:-bench-results/gpu-lease}
CKPT=${CKPT:-bench-results/gpu-ckpt}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
lscpu | grep -E '^(Model name|CPU\(s\))'
python3 -c "import sys, torch; from shoal.bench.checkpoints import fill_random_weights as f; \
from pathlib import Path; f(Path(sys.argv[1]), dtype=torch.bfloat16)" "$CKPT" || exit 1

stage() {
    local name=$1 limit=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped"; return ;; esac
    echo "== $name (limit $limit s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-40}" "$OUT/$name.log"
    echo "== $name: rc $rc, $((SECONDS - t0)) s"
}

# The engine's CUDA paths against HF on the same device.
TAIL=15 stage tests "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    tests/test_attention.py::test_paged_matches_dense_for_mixed_batches
# Issue 31: the node profile `shoal plan` sizes a GPU fleet from.
stage profile "${PROFILE_S:-200}" python3 -m shoal.cli profile --model "$CKPT" --device cuda \
    --dtype bfloat16 --max-num-seqs 256 --kv-cache-memory 16GiB \
    --decode-batches 1,2,4,8,16,32,64,128,256 --out "$OUT/profile-gpu-smollm2.json" \
    --samples "$OUT/profile-samples.jsonl"
# Issue 31: the simulator against one real GPU replica, from a profile taken right before.
# (Without the speed probe: two CUDA engine starts fewer within the stage's limit.)
TAIL=20 stage accuracy "${ACCURACY_S:-150}" python3 benchmarks/sim_accuracy.py --device cuda \
    --model "$CKPT" --quick --save "$OUT/accuracy"
# Its profile and, of each real run, the requests and the traced steps (to be simulated again
# here): one file, since few come back.
[ -d "$OUT/accuracy" ] && tar czf "$OUT/accuracy.tgz" -C "$OUT" accuracy && rm -rf "$OUT/accuracy"
TAIL=12 stage offline "${OFFLINE_S:-80}" python3 benchmarks/gpu_offline.py run "$CKPT" \
    --dtypes bfloat16 --graphs-only --batches 1,32,256
