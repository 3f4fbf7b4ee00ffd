#!/usr/bin/env bash
# The CI matrix: six fresh environments (core alone, core + each plugin package, everything),
# each installed from the packages' own pyproject.toml files and tested.
# Usage: bash scripts/test.sh [--only core,all] [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/envs.py matrix "$@"
