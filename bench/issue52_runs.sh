#!/usr/bin/env bash
# Issue 52's remaining training runs as one queue in priority order, drained by two workers (this
# machine has 2 cores: one run of one torch thread per core); a worker takes the next command no
# worker has taken, so neither idles while the other has a long list. Every run of the comparison
# is made at one commit, 541f812, from a git worktree of it (dstrain/ has changed since; a report
# across commits is refused unless asked for by name). Each command is a bench/accuracy_study.py
# study: a finished run is reported, not retrained; an interrupted one resumes from its checkpoint,
# so rerunning this script after a stop (SIGTERM: the runs checkpoint) continues where it was.
#
#   bench/issue52_runs.sh                       # both workers, in the background of a session
#   B8192_LAMB_LR=L bench/issue52_runs.sh       # once LAMB's LR at 8,192 is chosen: its seeds 1-2
#   bench/issue52_runs.sh --print               # the commands only
#
# Reports go to $REPORTS (default /work/logs/reports); copy a finished one into docs/results
# (or docs/results/tuning for held-out runs), register it in tools/results/registry.py and run
# python tools/evidence.py index. Stop with: pkill -TERM -f bench/accuracy_study.py
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
COMMIT=541f812
WORKTREE=${WORKTREE:-/work/study2}
REPORTS=${REPORTS:-/work/logs/reports}
STUDY="python bench/accuracy_study.py --epochs 90"

queue=(
  # item 2: the tuned baseline, 5 seeds on the test set (done at 541f812: reported, not rerun)
  "$STUDY --rows b128_lr0.4_tail --seeds 0 1 2 3 4 --runs runs/accuracy_study/final-90ep-b128 --name final_90ep_b128"
  # item 2: batch 4,096 (the chosen row), 5 seeds on the test set
  "$STUDY --rows fujitsu_span32_bn_lr0.1 --seeds 0 1 2 3 4 --runs runs/accuracy_study/final-90ep-b4096 --name final_90ep_b4096"
)
# item 2: batch 8,192's peak LR, chosen on the held-out images at 90 epochs by the worst of 3 seeds:
# LR 20 (92.82, 92.63, 92.73%: worst 92.63%) against LR 10 and 40, whose seed 0 alone (92.37%,
# 92.23%) bounds their worst of 3 below it, so their seeds 1-2 could not change the choice
B8192_LR=${B8192_LR:-20}
queue+=(
  # item 2: batch 8,192 at its chosen LR, 5 seeds on the test set
  "$STUDY --rows chosen_b8192 --seeds 0 1 2 3 4 --extra optim.base_lr=$B8192_LR --runs runs/accuracy_study/final-90ep-b8192-lr$B8192_LR --name final_90ep_b8192"
  # item 4: one change at a time from the chosen recipe, held-out, 3 seeds
  "$STUDY --holdout 6000 --rows fujitsu_span32_bn_lr0.1 chosen_no_ls chosen_no_tail --seeds 0 1 2 --runs runs/accuracy_study/ablation-90ep --name ablation_90ep_holdout6000_a"
  # item 4: Mikami's batch ramp on the chosen recipe, held-out, 3 seeds
  "$STUDY --holdout 6000 --rows chosen_ramp --seeds 0 1 2 --runs runs/accuracy_study/ablation-90ep --name ablation_90ep_holdout6000_b"
)
# item 4: LAMB against LARS at 8,192, LAMB with its own peak LR: a ladder a factor 2 apart around
# the fashion_mnist_lars recipe's 0.032 (seed 0), then the best LR's seeds 1-2 (B8192_LAMB_LR=L)
for lr in 0.016 0.032 0.064; do
  queue+=("$STUDY --holdout 6000 --rows chosen_b8192_lamb --seeds 0 --extra optim.base_lr=$lr --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr$lr --name chosen_b8192_lamb_lr${lr}_90ep_holdout6000")
done
if [[ -n "${B8192_LAMB_LR:-}" ]]; then
  queue+=("$STUDY --holdout 6000 --rows chosen_b8192_lamb --seeds 1 2 --extra optim.base_lr=$B8192_LAMB_LR --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr$B8192_LAMB_LR --name chosen_b8192_lamb_lr${B8192_LAMB_LR}_90ep_holdout6000_s1_2")
fi

# item 3: epochs to target with each batch's peak LR tuned, held-out, seed 0: the chosen recipe at
# each batch (--grid target) on a ladder of 3 LRs a factor 2 apart, from the linear rule's LR
# (10 x B/4,096) up past the square-root rule's (10 x sqrt(B/4,096)): batch 8,192's ladder is its
# tuning above (10, 20, 40), batch 4,096's LR 10 is the ablation's chosen row. Then
# bench/epochs_tuned.py picks each batch's LR by its epochs to each level (--reference: the tuned
# baseline's held-out run).
TARGET="python bench/accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --runs runs/accuracy_study/target-90ep-holdout6000"
# the ratios' base is the faster of batch 128 in this recipe and the tuned SGD baseline (same images)
queue+=("$STUDY --holdout 6000 --rows b128_lr0.4_tail --seeds 0 --runs runs/accuracy_study/target-90ep-holdout6000 --name b128_lr0.4_tail_90ep_holdout6000")
for pair in 128:0.5 128:1 128:2 512:1.25 512:2.5 512:5 1024:2.5 1024:5 1024:10 2048:2.5 2048:5 2048:10 4096:5 4096:20; do
  b=${pair%%:*} lr=${pair##*:}
  queue+=("$TARGET --rows target_b$b --extra optim.base_lr=$lr --name target_b${b}_lr${lr}_90ep_holdout6000")
done

if [[ "${1:-}" == "--print" ]]; then
  printf 'queue: %s\n' "${queue[@]}"
  exit 0
fi
if [[ ! -d "$WORKTREE" ]]; then
  git -C "$REPO" worktree add --detach "$WORKTREE" "$COMMIT"
fi
[[ "$(git -C "$WORKTREE" rev-parse --short=7 HEAD)" == "$COMMIT" ]] ||
  { echo "issue52_runs: $WORKTREE is not at $COMMIT" >&2; exit 2; }
mkdir -p "$REPORTS"
export PATH="$REPO/.venv/bin:$PATH" OMP_NUM_THREADS=1

CLAIMS=$(mktemp -d)  # command i is taken by the worker that makes $CLAIMS/i (mkdir is atomic)
trap 'rm -rf "$CLAIMS"' EXIT
worker() {  # NAME
  local name=$1 i
  for i in "${!queue[@]}"; do
    mkdir "$CLAIMS/$i" 2>/dev/null || continue
    echo "[issue52 worker $name] $(date -u +%H:%M) ${queue[$i]} --out $REPORTS"
    (cd "$WORKTREE" && ${queue[$i]} --out "$REPORTS") ||
      { echo "[issue52 worker $name] stopped" >&2; return 1; }
  done
}
worker 1 &
worker 2 &
wait
