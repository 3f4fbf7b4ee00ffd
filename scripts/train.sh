#!/usr/bin/env bash
# Set up .venv with every package (once; later runs only refresh it), then train.
# Usage: bash scripts/train.sh [gem-train run arguments, e.g. -c configs/tiny.yaml trainer.steps=50]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f .venv/.gem-ready ] || [ scripts/envs.py -nt .venv/.gem-ready ]; then
  python3 scripts/envs.py setup .venv --all
  touch .venv/.gem-ready
fi
exec .venv/bin/gem-train run "$@"
