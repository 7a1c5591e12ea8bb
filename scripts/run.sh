#!/usr/bin/env bash
# The main job, from a fresh machine: installs what is missing, builds once, then compares the op
# with torch's scaled_dot_product_attention on a few shapes (max error and timings).
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
setup_everything

cd "$ROOT"
"$PY" scripts/demo.py "$@"
