#!/usr/bin/env bash
# fagen's one GPU command: correctness on the hardware, speed against PyTorch's
# attention backends, peak memory, and compute-sanitizer, in under 8 minutes.
#
#   benchmarks/gpu_check.sh            # the full run (about 7 minutes)
#   benchmarks/gpu_check.sh --quick    # a subset (about 5 minutes)
#   benchmarks/gpu_check.sh --dry-run  # on any machine: versions, the plan, its time estimate, the checks
#
# Runs from the working tree (no install step). Writes results.json,
# results.md, four PNGs and gpu_check.log into $OUT when set (the device tool
# brings back what is there: at most 8 files), else ./gpu-check-results.
# The Python side keeps its own budget (420 s full, 290 s quick: every section's
# reserve fits it, compute-sanitizer's runs included; `--dry-run` prints the
# estimate) and writes results.json after every section; the hard `timeout` here
# (460 s, inside the device tool's 540 s) is the backstop:
# on it, Python gets SIGTERM, writes the report from what it has, and exits 124.
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-gpu-check-results}"
mkdir -p "$out_dir"
python="${PYTHON:-python3}"
limit="${FAGEN_GPU_CHECK_TIMEOUT:-460}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout --signal=TERM --kill-after=20 "$limit" "$python" -m fagen.bench gpu-check --out "$out_dir" "$@" 2>&1 \
    | tee "$out_dir/gpu_check.log"
status=${PIPESTATUS[0]}
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "gpu_check.sh: stopped at the ${limit} s limit (exit $status); partial results in $out_dir/results.json"
fi
exit "$status"
