#!/usr/bin/env bash
# gem-train profile, tune and tune --compare on one GPU (default configs/h200-large.yaml, CONFIG=...),
# in stages that each fit a 10-minute device command (benchmarks/results/profile.md has the runs).
#
#   bash benchmarks/profile_tune_h200.sh profile OUT [SECTIONS]  # the report (all sections: ~2.5-4 min)
#   bash benchmarks/profile_tune_h200.sh tune OUT PROFILE_DIR    # tune from a profile (5-minute budget)
#   bash benchmarks/profile_tune_h200.sh compare OUT TUNED       # the config against TUNED: warm-up, A B B A
#
# Packages come from PYTHONPATH (GEM_PLUGINS names the plugin modules); every command is cut off by
# `timeout`, and what each wrote so far (profile.json after every section, tune.json after every
# candidate) stays in OUT.
set -uo pipefail
stage=${1:?profile, tune or compare}; out=${2:?output folder}
export GEM_PLUGINS=${GEM_PLUGINS:-gem_kernels.plugin,gem_precision.plugin,gem_parallel.plugin,gem_comm.plugin}
export PYTHONUNBUFFERED=1
G="torchrun --standalone --nproc-per-node 1 -m gem_model"
C=${CONFIG:-configs/h200-large.yaml}
mkdir -p "$out"
t0=$(date +%s)
case $stage in
  profile)
    sections=${3:+--sections $3}
    timeout 260 $G profile -c "$C" --out "$out/profile" --batches 8 --warmup 3 --steps 3 --section-budget 150 \
      $sections > "$out/profile.log" 2>&1
    echo "profile rc=$? in $(( $(date +%s) - t0 )) s"; grep '^\[profile\]' "$out/profile.log"
    ;;
  tune)
    timeout 350 $G tune -c "$C" --budget 5 --steps 12 --repeats 2 --profile "${3:?the profile folder}" \
      --memory-gb 130 --out "$out/tune" > "$out/tune.log" 2>&1
    echo "tune rc=$? in $(( $(date +%s) - t0 )) s"; grep -A 80 'gem-train tune:' "$out/tune.log"
    ;;
  compare)
    timeout 300 $G tune -c "$C" --compare "${3:?the tuned config}" --steps 12 --out "$out/compare" \
      > "$out/compare.log" 2>&1
    echo "compare rc=$? in $(( $(date +%s) - t0 )) s"; grep -A 30 'gem-train tune --compare' "$out/compare.log"
    ;;
  *) echo "unknown stage $stage: profile, tune or compare" >&2; exit 2 ;;
esac
