#!/usr/bin/env bash
# The CI matrix: six fresh environments (core alone, core + each plugin package, everything),
# each installed from the packages' own pyproject.toml files and tested; each test runs in one of them.
# Usage: bash scripts/test.sh [--only core,all] [--jobs 2] [--keep] [-- pytest arguments]
#        bash scripts/test.sh --quick [-- pytest arguments]   # the fast tests in .venv, a few minutes
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--quick" ]]; then
    shift
    exec python3 scripts/envs.py quick "$@"
fi
exec python3 scripts/envs.py matrix "$@"
