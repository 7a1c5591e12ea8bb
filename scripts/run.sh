#!/usr/bin/env bash
# The main job, from a fresh machine: installs what is missing, builds once, then trains the same
# small byte-level GPT twice — with causal_attention's op and with torch's SDPA in the attention
# call, same seed — and prints how closely the loss curves agree and the speed of each, leaving
# the plot in runs/loss_curves.png. Extra arguments go to both training runs (e.g. --steps 100).
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
setup_everything

cd "$ROOT"
for attention in causal_attention sdpa; do
  banner "training with --attention $attention"
  "$PY" -m training.train --attention "$attention" --out "runs/$attention" "$@"
done
banner "comparison"
"$PY" -m training.compare_runs runs/causal_attention runs/sdpa --plot runs/loss_curves.png
