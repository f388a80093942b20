#!/usr/bin/env bash
# Issue 52's remaining training runs, in order, two lanes at a time (this machine has 2 cores: one
# run of one torch thread per core). Every run of the comparison is made at one commit, 541f812,
# from a git worktree of it (dstrain/ has changed since; a report across commits is refused unless
# asked for by name). Each lane is a list of bench/accuracy_study.py commands: a finished run is
# reported, not retrained; an interrupted one resumes from its checkpoint, so rerunning this script
# after a stop (SIGTERM: the runs checkpoint) continues where it was.
#
#   bench/issue52_runs.sh                 # both lanes, in the background of a session
#   B8192_LR=20 bench/issue52_runs.sh     # once batch 8,192's LR is chosen: its test-set seeds too
#   bench/issue52_runs.sh --print         # the commands only
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

lane_a=(
  # item 2: the tuned baseline, 5 seeds on the test set
  "$STUDY --rows b128_lr0.4_tail --seeds 0 1 2 3 4 --runs runs/accuracy_study/final-90ep-b128 --name final_90ep_b128"
  # item 2: batch 4,096 (the chosen row), 5 seeds on the test set
  "$STUDY --rows fujitsu_span32_bn_lr0.1 --seeds 0 1 2 3 4 --runs runs/accuracy_study/final-90ep-b4096 --name final_90ep_b4096"
  # item 4: one change at a time from the chosen recipe, held-out, 3 seeds
  "$STUDY --holdout 6000 --rows fujitsu_span32_bn_lr0.1 chosen_no_ls chosen_no_tail --seeds 0 1 2 --runs runs/accuracy_study/ablation-90ep --name ablation_90ep_holdout6000_a"
)
lane_b=(
  # item 2: batch 8,192's peak LR at 90 epochs on the held-out images (LR 10, 20, 40 seed 0
  # done: 20 best, 40 worst); seeds 1-2 of the two best
  "$STUDY --holdout 6000 --rows chosen_b8192 --seeds 1 2 --extra optim.base_lr=20 --runs runs/accuracy_study/tune-b8192-90ep-lr20 --name chosen_b8192_lr20_90ep_holdout6000_s1_2"
  "$STUDY --holdout 6000 --rows chosen_b8192 --seeds 1 2 --extra optim.base_lr=10 --runs runs/accuracy_study/tune-b8192-90ep-lr10 --name chosen_b8192_lr10_90ep_holdout6000_s1_2"
)
if [[ -n "${B8192_LR:-}" ]]; then
  lane_b+=(
    # item 2: batch 8,192 at its chosen LR, 5 seeds on the test set
    "$STUDY --rows chosen_b8192 --seeds 0 1 2 3 4 --extra optim.base_lr=$B8192_LR --runs runs/accuracy_study/final-90ep-b8192-lr$B8192_LR --name final_90ep_b8192"
    # item 4: the ramp and LAMB at 8,192, held-out, 3 seeds
    "$STUDY --holdout 6000 --rows chosen_ramp chosen_b8192_lamb --seeds 0 1 2 --runs runs/accuracy_study/ablation-90ep --name ablation_90ep_holdout6000_b"
  )
fi

# item 3: epochs to target with each batch's peak LR tuned, held-out, seed 0: the chosen recipe at
# each batch (--grid target) on a ladder of 3 LRs a factor 2 apart, from the linear rule's LR
# (10 x B/4,096) up past the square-root rule's (10 x sqrt(B/4,096)): batch 8,192's ladder is its
# tuning above (10, 20, 40), batch 4,096's LR 10 is the ablation's chosen row. Then
# bench/epochs_tuned.py picks each batch's LR by its epochs to each level (--reference: the tuned
# baseline's held-out run).
TARGET="python bench/accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --runs runs/accuracy_study/target-90ep-holdout6000"
# the ratios' base is the faster of batch 128 in this recipe and the tuned SGD baseline (same images)
lane_b+=("$STUDY --holdout 6000 --rows b128_lr0.4_tail --seeds 0 --runs runs/accuracy_study/target-90ep-holdout6000 --name b128_lr0.4_tail_90ep_holdout6000")
for pair in 128:0.5 128:1 128:2 512:1.25 512:2.5 512:5 1024:2.5 1024:5 1024:10 2048:2.5 2048:5 2048:10 4096:5 4096:20; do
  b=${pair%%:*} lr=${pair##*:}
  lane_b+=("$TARGET --rows target_b$b --extra optim.base_lr=$lr --name target_b${b}_lr${lr}_90ep_holdout6000")
done

if [[ "${1:-}" == "--print" ]]; then
  printf 'lane A: %s\n' "${lane_a[@]}"
  printf 'lane B: %s\n' "${lane_b[@]}"
  exit 0
fi
if [[ ! -d "$WORKTREE" ]]; then
  git -C "$REPO" worktree add --detach "$WORKTREE" "$COMMIT"
fi
[[ "$(git -C "$WORKTREE" rev-parse --short=7 HEAD)" == "$COMMIT" ]] ||
  { echo "issue52_runs: $WORKTREE is not at $COMMIT" >&2; exit 2; }
mkdir -p "$REPORTS"
export PATH="$REPO/.venv/bin:$PATH" OMP_NUM_THREADS=1

run_lane() {  # NAME COMMAND...
  local name=$1; shift
  for cmd in "$@"; do
    echo "[issue52 lane $name] $(date -u +%H:%M) $cmd --out $REPORTS"
    (cd "$WORKTREE" && $cmd --out "$REPORTS") || { echo "[issue52 lane $name] stopped" >&2; return 1; }
  done
}
run_lane A "${lane_a[@]}" &
run_lane B "${lane_b[@]}" &
wait
