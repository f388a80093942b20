#!/usr/bin/env bash
# Issue 52's remaining training runs as one queue in priority order, drained by two workers (this
# machine has 2 cores: one run of one torch thread per core); a worker takes the next command no
# worker has taken, so neither idles while the other has a long list. Every run of the comparison
# is made at one commit, 541f812, from a git worktree of it (dstrain/ has changed since; a report
# across commits is refused unless asked for by name). Each command is a bench/accuracy_study.py
# study: a finished run is reported, not retrained; an interrupted one resumes from its checkpoint,
# so rerunning this script after a stop (SIGTERM: the runs checkpoint) continues where it was, and
# started again while its runs go on (its bash workers stopped, the studies left running) it leaves
# the commands in flight to them (`--print` marks them `running`).
#
#   bench/issue52_runs.sh                       # both workers, in the background of a session
#   B4096_LR_SEEDS="5 10" bench/issue52_runs.sh  # seeds 1-2 of batch 4,096's LRs still in the running
#   B4096_LR=L bench/issue52_runs.sh            # once 4,096's LR is chosen: the ablation (at L)
#   B8192_LAMB_LR=L bench/issue52_runs.sh       # once LAMB's LR at 8,192 is chosen: its seeds 1-2
#   B8192_WARMUP_SEEDS=27 bench/issue52_runs.sh  # seeds 1-2 of batch 8,192's warmups still in the running
#   B4096_LR=20 B4096_WARMUP_SEEDS=27 bench/issue52_runs.sh  # the same for batch 4,096's (the ablation waits)
#   B4096_LR=20 B4096_WARMUP=27 bench/issue52_runs.sh  # once 4,096's warmup is chosen: its test-set
#                                                     # seeds and the ablation, made with it
#   DEADLINE=22:45 bench/issue52_runs.sh         # start only what can finish before the stop
#   bench/issue52_runs.sh --print               # the commands only
#
# A session's machine starts bare (runs/, the worktree and the reports are gone at its stop), so a
# command whose report is committed (docs/results or docs/results/tuning, by its --name) is skipped,
# and a command that needs runs finished in another session reads them from the committed reports
# (--reuse); a run not finished by a stop starts again from epoch 0 in the next session.
#
# Reports go to $REPORTS (default /work/logs/reports); copy a finished one (its .md, .json, .csv and
# the two .png its .md shows: tests/test_docs.py checks the links) into docs/results
# (or docs/results/tuning for held-out runs), register it in tools/results/registry.py and run
# python tools/evidence.py index. Stop with: pkill -TERM -f bench/issue52_runs.sh (the workers);
# pkill -TERM -f bench/accuracy_study.py; pkill -TERM -f -- '-m dstrain --config' (the runs, which
# checkpoint: 541f812's study does not hand the signal on to its trainers, bench/common.py does now)
set -euo pipefail
# the whole script is one block, read before any of it runs: an edit to this file while a queue
# runs (an in-place write, which bash would otherwise read on from its old offset) cannot reach it
{
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
)
# item 2: batch 4,096's peak LR at the goal's length. Its LR 10 is the recipe's, kept through
# issue 39's tuning at 30 epochs, while batch 8,192's was tuned at 90 epochs (and chose 20 over 10):
# the same budget for 4,096, held-out, a ladder a factor 2 apart, seed 0 first. LR 10's runs are the
# ablation's chosen row (the same runs directory: found finished there, not retrained).
B4096_TUNE="$STUDY --holdout 6000 --rows fujitsu_span32_bn_lr0.1"
b4096_runs() {  # LR: where the chosen row's held-out runs at that peak LR live
  if [[ "$1" == 10 ]]; then echo runs/accuracy_study/ablation-90ep  # the recipe's: the ablation's
  else echo "runs/accuracy_study/tune-b4096-90ep-lr$1"; fi
}
b4096_tuning() {  # LR SEEDS... : the chosen row at that peak LR, held-out
  local lr=$1 name seeds extra; shift
  seeds="$*"
  name="chosen_b4096_lr${lr}_90ep_holdout6000$([[ "$seeds" == "0" ]] || echo "_s${seeds// /_}")"
  extra="--extra optim.base_lr=$lr"
  [[ "$lr" != 10 ]] || extra=""
  echo "$B4096_TUNE --seeds $seeds $extra --runs $(b4096_runs "$lr") --name $name"
}
# LR 2.5 joined once LR 5's seed 0 came out best of the three (93.58% against 93.32% and 93.23%):
# a best LR at the ladder's edge gets the next rung below
for lr in 10 20 5 2.5; do queue+=("$(b4096_tuning "$lr" 0)"); done
# item 3's base, early (one run): with batch 8,192's LR ladder done it gives 8,192's ratio; the
# ratios' base is the faster of batch 128 in this recipe and the tuned SGD baseline (same images)
queue+=("$STUDY --holdout 6000 --rows b128_lr0.4_tail --seeds 0 --runs runs/accuracy_study/target-90ep-holdout6000 --name b128_lr0.4_tail_90ep_holdout6000")
# then seeds 1-2 of the LRs whose seed 0 could still be the worst-of-3 choice (B4096_LR_SEEDS="5 10";
# an LR whose seed 0 is below the leader's worst of 3 is out without them)
for lr in ${B4096_LR_SEEDS:-}; do queue+=("$(b4096_tuning "$lr" 1 2)"); done
# batch 8,192's warmup at its chosen LR, held-out, seed 0 (the baseline's budget was peak LR and
# warmup; the recipe's 40% warmup was chosen at 4,096 and 30 epochs): 20% and 30% of the epochs, the
# decay still ending at epoch 88 as the recipe's 36 + 52 does
for warmup in 18:70 27:61; do
  queue+=("$STUDY --holdout 6000 --rows chosen_b8192 --seeds 0 --extra optim.base_lr=$B8192_LR optim.warmup_epochs=${warmup%%:*} optim.decay_epochs=${warmup##*:} --runs runs/accuracy_study/tune-b8192-90ep-lr$B8192_LR-warmup${warmup%%:*} --name chosen_b8192_lr${B8192_LR}_warmup${warmup%%:*}_90ep_holdout6000")
done
# then seeds 1 and 2 (a command each: one fits where two would not) of a warmup whose seed 0 could
# still be the worst-of-3 choice against the recipe's 40% (B8192_WARMUP_SEEDS="27": the 30% warmup's
# seed 0 ended above the 40% warmup's three seeds; its seed 1 then ended below their worst, which
# settled it without seed 2)
decay_for() {  # VARIABLE WARMUP: the decay that ends a warmup tried at epoch 88 (exit 2 on another)
  case $2 in 18) echo 70 ;; 27) echo 61 ;; *) echo "issue52_runs: $1: $2 is not a warmup tried (18, 27)" >&2; exit 2 ;; esac
}
for w in ${B8192_WARMUP_SEEDS:-}; do
  decay=$(decay_for B8192_WARMUP_SEEDS "$w") || exit 2
  for seed in 1 2; do
    queue+=("$STUDY --holdout 6000 --rows chosen_b8192 --seeds $seed --extra optim.base_lr=$B8192_LR optim.warmup_epochs=$w optim.decay_epochs=$decay --runs runs/accuracy_study/tune-b8192-90ep-lr$B8192_LR-warmup$w --name chosen_b8192_lr${B8192_LR}_warmup${w}_90ep_holdout6000_s$seed")
  done
done
# once chosen (B4096_LR=L): at another LR than 10, its 5 test-set seeds (item 2) come first of what
# is left, and the ablation below is made at L (one change from the recipe as chosen)
test_set_seeds() {  # NAME ROWS REST: a row's 5 test-set seeds (item 2) in two commands, seeds 0-2
  # (report NAME) and 3-4 (NAME_s3_4), each of which fits a session, so both workers share them
  queue+=("$STUDY $2 --seeds 0 1 2 $3 --name $1" "$STUDY $2 --seeds 3 4 $3 --name ${1}_s3_4")
}
B4096_LR=${B4096_LR:-}
# and once batch 4,096's warmup is chosen too (B4096_WARMUP=W, one of the warmups tried, which needs
# B4096_LR): its test-set seeds and the ablation are made with it, under names and runs directories
# of their own (the 40% warmup's reports stay as they are)
B4096_WARMUP=${B4096_WARMUP:-}
W_EXTRA="" W_TAG=""
if [[ -n "$B4096_WARMUP" ]]; then
  [[ -n "$B4096_LR" ]] || { echo "issue52_runs: B4096_WARMUP needs B4096_LR (the warmups ran at it)" >&2; exit 2; }
  decay=$(decay_for B4096_WARMUP "$B4096_WARMUP") || exit 2
  W_EXTRA=" optim.warmup_epochs=$B4096_WARMUP optim.decay_epochs=$decay" W_TAG="_warmup$B4096_WARMUP"
fi
ABLATION_RUNS=runs/accuracy_study/ablation-90ep ABLATION_EXTRA=""
if [[ -n "$B4096_LR" && ( "$B4096_LR" != 10 || -n "$B4096_WARMUP" ) ]]; then
  test_set_seeds final_90ep_b4096_lr$B4096_LR$W_TAG "--rows fujitsu_span32_bn_lr0.1" "--extra optim.base_lr=$B4096_LR$W_EXTRA --runs runs/accuracy_study/final-90ep-b4096-lr$B4096_LR${W_TAG//_/-}"
  ABLATION_RUNS=runs/accuracy_study/ablation-90ep-lr$B4096_LR${W_TAG//_/-} ABLATION_EXTRA="--extra optim.base_lr=$B4096_LR$W_EXTRA"
fi
# item 1 at the goal's length: batch 128's peak LR at 90 epochs too (held-out, seed 0), a factor 2
# either side of the 0.4 its 30-epoch budget chose, as batch 4,096's and 8,192's LRs (and warmups)
# were tuned at 90 epochs (the LR 0.4 run is item 3's base, above): a reviewer asks whether the
# baseline's LR holds at the length the comparison is made at
for lr in 0.2 0.8; do
  queue+=("$STUDY --holdout 6000 --rows b128_lr${lr}_tail --seeds 0 --runs runs/accuracy_study/target-90ep-holdout6000 --name b128_lr${lr}_tail_90ep_holdout6000")
done
# 1.6 joined once 0.8's seed 0 came out best of the three (93.85% against 93.62% and 93.42%): the
# 0.8 row at LR 1.6 (541f812 has no b128_lr1.6 row), in a runs directory of its own
queue+=("$STUDY --holdout 6000 --rows b128_lr0.8_tail --seeds 0 --extra optim.base_lr=1.6 --runs runs/accuracy_study/target-90ep-holdout6000-lr1.6 --name b128_lr1.6_tail_90ep_holdout6000")
# then seeds 1-2 of the LRs whose seed 0 could still be the worst-of-3 choice (B128_LR_SEEDS="0.8":
# 0.8's seeds 1-2 ended at 94.08% and 94.18%, so its worst of 3 is its seed 0's 93.85%, above the
# seed 0 of 0.2, 0.4 and 1.6, which are out without theirs), and once one other than 0.4 is chosen
# (B128_LR=L; 0.8 was) the baseline's 5 test-set seeds at it, in two commands as batch 4,096's
for lr in ${B128_LR_SEEDS:-}; do
  queue+=("$STUDY --holdout 6000 --rows b128_lr${lr}_tail --seeds 1 2 --runs runs/accuracy_study/target-90ep-holdout6000 --name b128_lr${lr}_tail_90ep_holdout6000_s1_2")
done
if [[ -n "${B128_LR:-}" && "$B128_LR" != 0.4 ]]; then
  test_set_seeds final_90ep_b128_lr$B128_LR "--rows b128_lr${B128_LR}_tail" "--runs runs/accuracy_study/final-90ep-b128-lr$B128_LR"
fi
# batch 4,096's warmup too, as batch 8,192's (the recipe's 40% was chosen at 30 epochs; a reviewer
# asks why one large batch had the warmup tuned and the other not): 20% and 30%, the decay still
# ending at epoch 88, held-out, seed 0, at its chosen LR: waits for B4096_LR (LR 5's seed 0 beat the
# recipe's 10, so a warmup tried at 10 could be a try at an LR not chosen)
if [[ -n "$B4096_LR" ]]; then
  for warmup in 18:70 27:61; do
    queue+=("$B4096_TUNE --seeds 0 --extra optim.base_lr=$B4096_LR optim.warmup_epochs=${warmup%%:*} optim.decay_epochs=${warmup##*:} --runs runs/accuracy_study/tune-b4096-90ep-lr$B4096_LR-warmup${warmup%%:*} --name chosen_b4096_lr${B4096_LR}_warmup${warmup%%:*}_90ep_holdout6000")
  done
fi
# then seeds 1 and 2 (a command each) of batch 4,096's warmup still in the running
# (B4096_WARMUP_SEEDS="27": the 30% warmup's seed 0 ended at 93.62%, above the three seeds of the
# recipe's 40% at LR 20); while one is, the ablation waits (its rows are one change from the recipe
# as chosen, and a new warmup would be part of it)
# (a warmup chosen, B4096_WARMUP below, was chosen on its 3 seeds: they are listed with it)
for w in $(printf '%s\n' ${B4096_WARMUP_SEEDS:-} ${B4096_WARMUP:-} | sort -un); do
  [[ -n "$B4096_LR" ]] || { echo "issue52_runs: B4096_WARMUP_SEEDS needs B4096_LR (the warmups ran at it)" >&2; exit 2; }
  decay=$(decay_for B4096_WARMUP_SEEDS "$w") || exit 2
  for seed in 1 2; do
    queue+=("$B4096_TUNE --seeds $seed --extra optim.base_lr=$B4096_LR optim.warmup_epochs=$w optim.decay_epochs=$decay --runs runs/accuracy_study/tune-b4096-90ep-lr$B4096_LR-warmup$w --name chosen_b4096_lr${B4096_LR}_warmup${w}_90ep_holdout6000_s$seed")
  done
done
# item 4: LAMB against LARS at 8,192, LAMB with its own peak LR: a ladder a factor 2 apart around
# the fashion_mnist_lars recipe's 0.032 (seed 0), then the best LR's seeds 1-2 (B8192_LAMB_LR=L);
# 0.128 joined once 0.064 came out best of the three (91.85% against 91.53% and 90.78%): a best LR
# at the ladder's edge gets the next rung
for lr in 0.016 0.032 0.064 0.128; do
  queue+=("$STUDY --holdout 6000 --rows chosen_b8192_lamb --seeds 0 --extra optim.base_lr=$lr --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr$lr --name chosen_b8192_lamb_lr${lr}_90ep_holdout6000")
done
if [[ -n "${B8192_LAMB_LR:-}" ]]; then
  queue+=("$STUDY --holdout 6000 --rows chosen_b8192_lamb --seeds 1 2 --extra optim.base_lr=$B8192_LAMB_LR --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr$B8192_LAMB_LR --name chosen_b8192_lamb_lr${B8192_LAMB_LR}_90ep_holdout6000_s1_2")
fi
# item 4: one change at a time from the chosen recipe, held-out, 3 seeds, each row as two commands
# (seeds 0-1, then 2: two workers share them, and a session's end cuts fewer runs; bench/ablation.py
# reads the reports together); waits for B4096_LR, and for batch 4,096's warmup (B4096_WARMUP_SEEDS)
# (the warmup chosen with B4096_WARMUP settles it)
if [[ -n "$B4096_LR" && ( -z "${B4096_WARMUP_SEEDS:-}" || -n "$B4096_WARMUP" ) ]]; then
  # the chosen row's 3 seeds are its tuning's, read from this checkout's reports (the worktree's
  # docs/ are 541f812's): a report, nothing trained
  if [[ -n "$B4096_WARMUP" ]]; then  # the warmup's seeds 0, 1 and 2, a report each
    chosen_runs=runs/accuracy_study/tune-b4096-90ep-lr$B4096_LR-warmup$B4096_WARMUP
    chosen_reports=""
    for s in "" _s1 _s2; do
      chosen_reports+="${chosen_reports:+ }$REPO/docs/results/tuning/chosen_b4096_lr${B4096_LR}_warmup${B4096_WARMUP}_90ep_holdout6000$s.json"
    done
  else
    chosen_runs=$(b4096_runs "$B4096_LR")
    chosen_reports="$REPO/docs/results/tuning/chosen_b4096_lr${B4096_LR}_90ep_holdout6000.json $REPO/docs/results/tuning/chosen_b4096_lr${B4096_LR}_90ep_holdout6000_s1_2.json"
  fi
  queue+=("$STUDY --holdout 6000 --rows fujitsu_span32_bn_lr0.1 --seeds 0 1 2 $ABLATION_EXTRA --runs $chosen_runs --name ablation_90ep_holdout6000_fujitsu_span32_bn_lr0.1$W_TAG --reuse $chosen_reports")
  # the ramp is half the batch through the warmup: through the chosen one
  ramp_extra() { [[ "$1" != chosen_ramp || -z "$B4096_WARMUP" ]] || echo " batch.ramp=[[$B4096_WARMUP,4096]]"; }
  for row in chosen_no_ls chosen_no_tail chosen_ramp; do
    queue+=("$STUDY --holdout 6000 --rows $row --seeds 0 1 $ABLATION_EXTRA$(ramp_extra $row) --runs $ABLATION_RUNS --name ablation_90ep_holdout6000_$row$W_TAG")
  done
  for row in chosen_no_ls chosen_no_tail chosen_ramp; do
    queue+=("$STUDY --holdout 6000 --rows $row --seeds 2 $ABLATION_EXTRA$(ramp_extra $row) --runs $ABLATION_RUNS --name ablation_90ep_holdout6000_$row${W_TAG}_s2")
  done
fi
# item 3: epochs to target with each batch's peak LR tuned, held-out, seed 0: the chosen recipe at
# each batch (--grid target) on a ladder of 3 LRs a factor 2 apart, from the linear rule's LR
# (10 x B/4,096) up past the square-root rule's (10 x sqrt(B/4,096)): batch 8,192's and 4,096's
# ladders are their tunings above (FILE:ROW for bench/epochs_tuned.py). Then bench/epochs_tuned.py
# picks each batch's LR by its epochs to each level (--reference: the tuned baseline's held-out run,
# queued earlier).
# Each LR has a runs directory of its own: a row's run there is named by row and seed, not LR, and
# the study refuses a kept run of other settings
TARGET="python bench/accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9"
# 128:0.25, 512:0.625 and 1024:1.25 joined once the ladder's lowest LR came out fastest to 90% at
# each (128: epoch 26 at LR 0.5 against 47 and 58; 512: 27 at LR 1.25 against 46 and 58; 1,024: 38
# at LR 2.5 against 45 and 50): a best LR at the ladder's edge gets the next rung below; 2048:1.25
# so (epoch 36 at LR 2.5 against 41 and 50), and 1024:0.625 once LR 1.25 came out faster still
# (epoch 33); the rungs below 128's, 512's and 2,048's came out slower (epoch 29, 31, 41)
for pair in 128:0.5 128:1 128:2 512:1.25 512:2.5 512:5 1024:2.5 1024:5 1024:10 2048:2.5 2048:5 2048:10 128:0.25 512:0.625 1024:1.25 2048:1.25 1024:0.625; do
  b=${pair%%:*} lr=${pair##*:}
  queue+=("$TARGET --rows target_b$b --extra optim.base_lr=$lr --runs runs/accuracy_study/target-90ep-holdout6000-lr$lr --name target_b${b}_lr${lr}_90ep_holdout6000")
done
reported() {  # COMMAND: its report (--name) is committed
  local name
  [[ " $1 " =~ \ --name\ ([^ ]+)\  ]] || return 1
  name=${BASH_REMATCH[1]}
  [[ -f "$REPO/docs/results/$name.json" || -f "$REPO/docs/results/tuning/$name.json" ]]
}
# a trainer (python -m dstrain) whose study is gone: 541f812's study, stopped with SIGTERM, left its
# trainers running (bench/common.py hands the signal on since), so one can train on with no study
orphans() {  # the command lines of trainers whose parent is no study, one a line
  local pid parent
  for pid in $(pgrep -f -- '-m dstrain --config' || true); do
    parent=$(ps -o ppid= -p "$pid" | tr -d ' ')
    [[ $(ps -o args= -p "$parent" 2>/dev/null) == *bench/accuracy_study.py* ]] && continue
    # (a trainer that ends meanwhile leaves no /proc entry: the 2> comes first to quiet that too)
    tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline" && echo
  done
}
running() {  # COMMAND: a study of its --name runs now (a queue started again beside one in flight),
  # or a trainer of one of its runs does (run_dir=RUNS/ROW-SEED), a study's or an orphan's
  local name runs rows seeds row seed
  [[ " $1 " =~ \ --name\ ([^ ]+)\  ]] || return 1
  name=${BASH_REMATCH[1]}
  pgrep -f -- "bench/accuracy_study\.py .*--name ${name//./\\.}( |\$)" > /dev/null && return 0
  [[ " $1 " =~ \ --runs\ ([^ ]+)\  ]] || return 1
  runs=${BASH_REMATCH[1]}
  [[ " $1 " =~ \ --rows\ ([^-][^ ]*( [^-][^ ]*)*)\  ]] || return 1
  rows=${BASH_REMATCH[1]}
  [[ " $1 " =~ \ --seeds\ ([0-9]+( [0-9]+)*)\  ]] || return 1
  seeds=${BASH_REMATCH[1]}
  for row in $rows; do
    for seed in $seeds; do
      pgrep -f -- "-m dstrain --config .* run_dir=${runs//./\\.}/${row//./\\.}-$seed( |\$)" > /dev/null && return 0
    done
  done
  return 1
}
everything=("${queue[@]}")
todo=()
for cmd in "${queue[@]}"; do
  reported "$cmd" || running "$cmd" || todo+=("$cmd")
done
queue=("${todo[@]}")
# A run not finished by a session's stop is lost with the machine, so with DEADLINE (a time `date -d`
# reads, e.g. DEADLINE=22:45; a bare HH:MM already past is tomorrow's) a worker starts only a command whose runs can end before it, at
# RUN_MINUTES a run (90 epochs, one thread: about 32 min here): one that cannot is left for the
# next session and the worker takes a shorter one further down the queue
RUN_MINUTES=${RUN_MINUTES:-35}
if [[ -n "${DEADLINE:-}" ]]; then
  END=$(date -d "$DEADLINE" +%s) || { echo "issue52_runs: DEADLINE=$DEADLINE is not a time" >&2; exit 2; }
  # a bare HH:MM already past today is tonight's stop after midnight (a session is 3 hours)
  if [[ "$DEADLINE" =~ ^[0-9]{1,2}:[0-9]{2}$ ]] && (( END <= $(date +%s) )); then
    END=$(date -d "$DEADLINE tomorrow" +%s)
  fi
  (( END > $(date +%s) )) || { echo "issue52_runs: DEADLINE=$DEADLINE has passed" >&2; exit 2; }
fi
fits() {  # COMMAND: it can finish before DEADLINE (always, without one)
  [[ -n "${END:-}" ]] || return 0
  local seeds
  [[ " $1 " =~ \ --seeds\ ([0-9 ]+)\  ]] || return 0
  seeds=$(wc -w <<< "${BASH_REMATCH[1]}")
  # batch 128 takes as long as 4,096 here (1,469 s for b128_lr0.2_tail's held-out run beside one
  # other, 1,869 s for batch 4,096's): the steps are cheaper as they are more
  (( $(date +%s) + seeds * RUN_MINUTES * 60 <= END ))
}
if [[ "${1:-}" == "--print" ]]; then  # in queue order; queue: to run; later: cannot end by DEADLINE
  for cmd in "${everything[@]}"; do
    if reported "$cmd"; then echo "reported: $cmd"
    elif running "$cmd"; then echo "running: $cmd"
    elif fits "$cmd"; then echo "queue: $cmd"
    else echo "later: $cmd"; fi
  done
  exit 0
fi
if [[ ! -d "$WORKTREE" ]]; then
  git -C "$REPO" worktree add --detach "$WORKTREE" "$COMMIT"
fi
[[ "$(git -C "$WORKTREE" rev-parse --short=7 HEAD)" == "$COMMIT" ]] ||
  { echo "issue52_runs: $WORKTREE is not at $COMMIT" >&2; exit 2; }
mkdir -p "$REPORTS"
[[ -n "$B4096_LR" ]] ||
  echo "issue52_runs: the ablation and batch 4,096's warmup pair wait for its LR: B4096_LR=L $0 queues them" >&2
export PATH="$REPO/.venv/bin:$PATH" OMP_NUM_THREADS=1

CLAIMS=$(mktemp -d)  # command i is taken by the worker that makes $CLAIMS/i (mkdir is atomic)
trap 'rm -rf "$CLAIMS"' EXIT
# one study a core: studies already running on this machine (an earlier queue's, left going when
# its workers were stopped) hold theirs, and so does an orphaned trainer, so a worker waits for a
# free one before it starts a command
CORES=${CORES:-2} POLL_S=${POLL_S:-15}
studies() { echo $(( $(pgrep -fc 'bench/accuracy_study\.py' || true) + $(orphans | grep -c . || true) )); }
worker() {  # NAME
  local name=$1 i pid lock
  exec {lock}>"$CLAIMS/cores.lock"
  for i in "${!queue[@]}"; do
    fits "${queue[$i]}" || continue
    running "${queue[$i]}" && continue
    mkdir "$CLAIMS/$i" 2>/dev/null || continue
    flock "$lock"  # one worker at a time looks for a free core and starts its command
    while (( $(studies) >= CORES )); do sleep "$POLL_S"; done
    if ! fits "${queue[$i]}"; then flock -u "$lock"; continue; fi  # the wait took too long
    echo "[issue52 worker $name] $(date -u +%H:%M) ${queue[$i]} --out $REPORTS"
    # split into words, never globbed (batch.ramp=[[27,4096]] is a bracket pattern to bash)
    (set -f && cd "$WORKTREE" && exec ${queue[$i]} --out "$REPORTS") &
    pid=$!
    # hold the lock until its study shows in the process list (or has already ended), so the
    # next worker counts it
    for _ in $(seq 50); do running "${queue[$i]}" || ! kill -0 "$pid" 2>/dev/null && break; sleep 0.2; done
    flock -u "$lock"
    wait "$pid" || { echo "[issue52 worker $name] stopped" >&2; return 1; }
  done
}
worker 1 &
worker 2 &
wait
exit
}
