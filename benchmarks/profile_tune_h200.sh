#!/usr/bin/env bash
# gem-train profile, tune and tune --compare on one GPU with configs/h200-large.yaml, in two calls
# that each fit a 10-minute device command (benchmarks/results/profile.md has the runs).
#
#   bash benchmarks/profile_tune_h200.sh profile-tune OUT   # profile (~2.5-4 min), then tune from it (4 min)
#   bash benchmarks/profile_tune_h200.sh compare OUT TUNED  # the hand-made config against TUNED, A B B A
#
# Packages come from PYTHONPATH (GEM_PLUGINS names the plugin modules); every command is cut off by
# `timeout`, and what each wrote so far (profile.json after every section, tune.json after every
# candidate) stays in OUT.
set -uo pipefail
stage=${1:?profile-tune or compare}; out=${2:?output folder}
export GEM_PLUGINS=${GEM_PLUGINS:-gem_kernels.plugin,gem_precision.plugin,gem_parallel.plugin,gem_comm.plugin}
export PYTHONUNBUFFERED=1
G="torchrun --standalone --nproc-per-node 1 -m gem_model"
C=${CONFIG:-configs/h200-large.yaml}
mkdir -p "$out"
case $stage in
  profile-tune)
    t0=$(date +%s)
    timeout 260 $G profile -c $C --out "$out/profile" --batches 8 --warmup 3 --steps 3 --section-budget 150 \
      > "$out/profile.log" 2>&1
    echo "profile rc=$? in $(( $(date +%s) - t0 )) s"; grep '^\[profile\]' "$out/profile.log"
    t0=$(date +%s)
    timeout 290 $G tune -c $C --budget 4 --steps 8 --profile "$out/profile" --memory-gb 130 --out "$out/tune" \
      > "$out/tune.log" 2>&1
    echo "tune rc=$? in $(( $(date +%s) - t0 )) s"; tail -n 40 "$out/tune.log"
    ;;
  compare)
    tuned=${3:?the tuned config}
    t0=$(date +%s)
    timeout 500 $G tune -c $C --compare "$tuned" --steps 8 --out "$out/compare" > "$out/compare.log" 2>&1
    echo "compare rc=$? in $(( $(date +%s) - t0 )) s"; tail -n 20 "$out/compare.log"
    ;;
  *) echo "unknown stage $stage: profile-tune or compare" >&2; exit 2 ;;
esac
