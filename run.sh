#!/usr/bin/env bash
# One entry point that sets everything up (idempotently) and then does the job.
#   ./run.sh train [--config R] [--deepspeed_config J] [key=value ...]   train (default: Fashion-MNIST recipe)
#   ./run.sh test  [pytest args ...]                                     lint (ruff), then the test suite
#   ./run.sh test-oldest [pytest args ...]                               the `oldest` tests on torch 2.11
#   ./run.sh evidence                                                    fault tests -> results/bench/faults.md
#   ./run.sh results FILE ... | --stale | --index                        rerun results' commands; which are
#                                                                        stale; render the tables
#   ./run.sh gpu-prepare [--python-version 3.12]                         build .gpu/ for a GPU node (here)
#   ./run.sh gpu [PART ...] [--budget PART=S] [--status] | --receive     one GPU job, offline (on the node)
#   ./run.sh gpu-import FILE                                             a job's gpu_state.tar.gz, here
#   ./run.sh rcp-check RUN_DIR... | FOLDER [--json F]                    MLPerf's RCP checker on 5 runs
#   ./run.sh mlperf-package RUNS --system F --out D | --template         a submission package, judged
#   ./run.sh setup [--oldest]                                            only install (--oldest: test-oldest's
#                                                                        venv too, beside it, as CI does)
# Environment: PYTHON (interpreter for the venv, default python3), DSTRAIN_VENV (default .venv),
#   DSTRAIN_OLDEST_VENV (test-oldest's, default .venv-oldest),
#   DSTRAIN_TEST_WORKERS (pytest-xdist workers for `test`, default 2), DSTRAIN_SETUP_NEED_GB (free disk
#   an install checks for first, default 8, 6 for test-oldest's venv, half to update a venv; 0 skips the check).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${DSTRAIN_VENV:-.venv}
OLDEST_VENV=${DSTRAIN_OLDEST_VENV:-.venv-oldest}  # test-oldest's (requirements-oldest.txt)
FMNIST_DIR=/usr/share/datasets/fashion-mnist
# test and test-oldest: pytest-xdist, DSTRAIN_TEST_WORKERS workers (2; one per core on CI's 2 cores),
# tests that share a session's run or the multi-host harness kept on one worker (xdist_group);
# `-n 0` after the command runs everything in one process
XDIST=(-n "${DSTRAIN_TEST_WORKERS:-2}" --dist loadgroup)

# run.sh's own messages go to stderr: a command's stdout is its output alone
# (./run.sh mlperf-package --template > my_system.json)
say() { echo "[run.sh] $*" >&2; }

reqs_hash() { sha256sum < "$1" | cut -d' ' -f1; }  # REQS: what $VENV's stamp holds once installed

venv_current() {  # REQS: $VENV holds what REQS pins (its stamp is REQS's hash)
    local stamp="$VENV/.dstrain-requirements"
    [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$(reqs_hash "$1")" ]]
}

venv_need() {  # REQS: GB of free disk installing REQS into $VENV needs (0: it is up to date)
    # torch 2.11's venv (requirements-oldest.txt) takes ~5 GB, the current one's ~7; a venv that
    # exists (its requirements changed) keeps what it has, and its update unpacks less
    local need=8
    if venv_current "$1"; then echo 0; return; fi
    [[ $1 == requirements-oldest.txt ]] && need=6
    [[ -x "$VENV/bin/python" ]] && need=$(( need / 2 ))
    echo "$need"
}

setup_venv() {  # [requirements file] [--disk-checked: the caller checked the free disk for it]
    local reqs=${1:-requirements.txt}
    if venv_current "$reqs"; then
        say "virtual environment $VENV is up to date"
        [[ -x "$VENV/bin/dstrain" ]] || install_dstrain
        return
    fi
    local whose=venv
    [[ $reqs == requirements-oldest.txt ]] && whose=oldest  # test-oldest's, in $VENV here
    [[ ${2:-} == --disk-checked ]] || check_free_disk "$(venv_need "$reqs")" "$whose"
    say "creating $VENV and installing $reqs (first time: several minutes, ~6 GB with CUDA torch)"
    "$PYTHON" -m venv "$VENV"
    # An empty PIP_FIND_LINKS keeps pip on the package index: a local CPU-only torch wheel would
    # not match the torchvision build from the index.
    PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # --no-compile, then every core compiles the bytecode: pip compiles each wheel's files on one
    # core as it unpacks it (~30 s of the install on 2 cores, all of it idle on the others); the
    # venv ends with the same .pyc files, so no rank compiles modules at its first start
    PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet --no-compile -r "$reqs"
    "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true
    install_dstrain
    reqs_hash "$reqs" > "$VENV/.dstrain-requirements"
}

setup_both_venvs() {  # $VENV and test-oldest's venv side by side, one disk check for the two (CI):
    # pip downloads, unpacks and installs on one core, so one install at a time left a core idle
    local pid need need_oldest
    need=$(venv_need requirements.txt)
    need_oldest=$(VENV=$OLDEST_VENV; venv_need requirements-oldest.txt)
    if [[ "$(disk_of "$VENV")" == "$(disk_of "$OLDEST_VENV")" ]]; then
        check_free_disk $(( need + need_oldest )) both
    else  # each venv's own disk, and pip's unpacking of both in $TMPDIR
        check_free_disk "$need" venv "$(nearest_dir "$VENV")"
        check_free_disk "$need_oldest" oldest "$(nearest_dir "$OLDEST_VENV")"
        check_free_disk $(( need + need_oldest )) both "${TMPDIR:-/tmp}"
    fi
    ( VENV=$OLDEST_VENV; setup_venv requirements-oldest.txt --disk-checked ) &
    pid=$!
    trap 'pkill -P "$pid" 2> /dev/null; kill "$pid" 2> /dev/null || true' EXIT  # one failing ends both
    setup_venv requirements.txt --disk-checked
    wait "$pid" || { say "error: installing $OLDEST_VENV (requirements-oldest.txt) failed: its messages are above"; exit 1; }
    trap - EXIT
}

nearest_dir() {  # PATH: the nearest folder that exists at or above PATH's parent (where it would go)
    local dir
    dir=$(dirname "$(realpath -m "$1")")
    while [[ ! -d "$dir" ]]; do dir=$(dirname "$dir"); done
    echo "$dir"
}

disk_of() {  # PATH: the mount point of the disk PATH would be written to
    df -P "$(nearest_dir "$1")" | awk 'NR == 2 { print $6 }'
}

check_free_disk() {  # GB [venv | oldest | both: whose install, default venv] [folders, default
    # $VENV's and $TMPDIR] (DSTRAIN_SETUP_NEED_GB overrides GB): before an install, as pip stops
    # half-way with Errno 28 on a full disk; pip unpacks the wheels in $TMPDIR first
    local need=${DSTRAIN_SETUP_NEED_GB:-$1} what where dir free_kb dirs
    case ${2:-venv} in  # the refusal names the folder(s) and the variable that moves them
        venv) what=$VENV where="DSTRAIN_VENV (the venv)" ;;
        oldest) what=$OLDEST_VENV where="DSTRAIN_OLDEST_VENV (test-oldest's venv)" ;;
        both) what="$VENV, $OLDEST_VENV" where="DSTRAIN_VENV or DSTRAIN_OLDEST_VENV (the venvs)" ;;
        *) say "error: check_free_disk: unknown install '$2' (venv, oldest or both)"; exit 1 ;;
    esac
    dirs=("${@:3}")
    (( ${#dirs[@]} )) || dirs=("$(nearest_dir "$VENV")" "${TMPDIR:-/tmp}")
    for dir in "${dirs[@]}"; do
        while [[ ! -d "$dir" ]]; do dir=$(dirname "$dir"); done
        free_kb=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
        if (( free_kb < need * 1024 * 1024 )); then
            say "error: setup needs about $need GB free for $what and pip's unpacking, and $dir has" \
                "$(( free_kb / 1024 / 1024 )) GB: free space there, or point $where" \
                "or TMPDIR (pip's unpacking) at a larger disk; DSTRAIN_SETUP_NEED_GB=0 skips this check"
            exit 1
        fi
    done
}

install_dstrain() {  # this checkout, editable, no dependencies: the `dstrain` command in $VENV/bin
    say "installing this checkout into $VENV (pip install -e .: the dstrain command)"
    # quiet (setuptools warns of any folder named like the package); a failure says why below
    # (a venv without setuptools, as test-oldest's, builds it isolated; its warnings only on a failure)
    local out
    PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e . \
        > /dev/null 2>&1 && return
    out=$(PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet --no-deps -e . 2>&1) ||
        { printf '%s\n' "$out" >&2; return 1; }
}

setup_fashion_mnist() {
    if compgen -G "$FMNIST_DIR/train-images-idx3-ubyte*" > /dev/null; then
        say "Fashion-MNIST found in $FMNIST_DIR"
        return
    fi
    local sudo=""
    [[ $(id -u) -ne 0 ]] && command -v sudo > /dev/null && sudo="sudo -n"
    if command -v apt-get > /dev/null && { [[ $(id -u) -eq 0 ]] || [[ -n "$sudo" ]]; }; then
        say "installing the Debian package dataset-fashion-mnist"
        if ! { $sudo apt-get install -y -qq dataset-fashion-mnist > /dev/null 2>&1 ||
               { $sudo apt-get update -qq > /dev/null 2>&1 &&
                 $sudo apt-get install -y -qq dataset-fashion-mnist > /dev/null 2>&1; }; }; then
            say "apt-get could not install dataset-fashion-mnist; the trainer will try a torchvision download"
        fi
    else
        say "no apt-get (or no root): the trainer will try a torchvision download, or set data.root=DIR"
    fi
}

setup_multihost_tools() {  # sshd, pdsh, mpirun for tests/test_multihost.py (skipped, with why, without them)
    if command -v pdsh > /dev/null && command -v mpirun > /dev/null && [[ -x /usr/sbin/sshd ]]; then return; fi
    if command -v apt-get > /dev/null && [[ $(id -u) -eq 0 ]]; then
        say "installing openssh-server, pdsh and openmpi-bin (the multi-host launch tests)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server pdsh openmpi-bin > /dev/null 2>&1 ||
            { apt-get update -qq > /dev/null 2>&1 &&
              DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server pdsh openmpi-bin > /dev/null 2>&1; } ||
            say "could not install openssh-server/pdsh/openmpi-bin: the multi-host tests will be skipped"
    else
        say "no sshd/pdsh/mpirun (and no root apt-get): the multi-host tests will be skipped"
    fi
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case "$cmd" in
    setup)
        if [[ "${1:-}" == --oldest ]]; then setup_both_venvs; else setup_venv; fi
        setup_fashion_mnist ;;
    train)
        setup_venv; setup_fashion_mnist
        if [[ $# -eq 0 ]]; then set -- --config fashion_mnist; fi
        exec "$VENV/bin/python" -m dstrain "$@" ;;
    test)
        setup_venv; setup_fashion_mnist; setup_multihost_tools
        say "ruff: lint and format check (pyproject.toml [tool.ruff]; fix with: $VENV/bin/ruff format . && $VENV/bin/ruff check --fix .)"
        "$VENV/bin/ruff" check dstrain tests bench tools results
        "$VENV/bin/ruff" format --check dstrain tests bench tools results
        exec "$VENV/bin/python" -m pytest "${XDIST[@]}" "$@" ;;
    test-oldest)
        # the oldest torch pyproject.toml declares, in its own venv: the tests marked `oldest`
        VENV=$OLDEST_VENV
        setup_venv requirements-oldest.txt; setup_fashion_mnist
        "$VENV/bin/python" -c 'import torch; print("[run.sh] torch", torch.__version__)'
        exec "$VENV/bin/python" -m pytest -m oldest "${XDIST[@]}" "$@" ;;
    evidence)
        setup_venv; setup_fashion_mnist
        exec "$VENV/bin/python" -m pytest -q tests/test_cli_errors.py tests/test_faults.py tests/test_watchdog.py \
            "tests/test_ds_config.py::test_bad_json_values_and_nested_keys_give_one_line_naming_file_and_key" \
            "tests/test_e2e.py::test_corrupt_image_stops_the_run_with_one_line" \
            --evidence results/bench/faults.md "$@" ;;
    gpu-prepare)
        # here, with the package index: the node's wheels, DALI in parts, Fashion-MNIST, the job list
        setup_venv; setup_fashion_mnist
        exec "$VENV/bin/python" tools/gpu_prepare.py "$@" ;;
    gpu)
        # On the node (no network): the job's clock starts now, install counted; what the job brought
        # (.gpu/wheels, .gpu/dali-N) is installed into /tmp once (tools/gpu_node.py), then the parts
        export DSTRAIN_GPU_JOB_START=${DSTRAIN_GPU_JOB_START:-$(date +%s.%N)}
        BASE="$VENV/bin/python"; [[ -x "$BASE" ]] || BASE=$PYTHON
        PY=$BASE
        # a ferry job brings one DALI part and runs nothing else (tools/gpu_prepare.py's slot plan)
        if [[ "$*" == "--receive" ]]; then exec "$BASE" tools/gpu_node.py receive; fi
        if [[ " $* " != *" --status "* ]]; then
            assignments=$("$BASE" tools/gpu_node.py install) || exit 2
            eval "$assignments"
        fi
        exec "$PY" tools/gpu_run.py "$@" ;;
    rcp-check)
        # MLPerf's RCP checker on 5 runs' mlperf.log (tools/rcp_check.py, docs/mlperf.md)
        setup_venv
        exec "$VENV/bin/python" tools/rcp_check.py "$@" ;;
    mlperf-package)
        # a submission package from 5 runs, judged by MLPerf's package checker (tools/mlperf_package.py)
        setup_venv
        exec "$VENV/bin/python" tools/mlperf_package.py "$@" ;;
    gpu-import)
        # here: a job's gpu_state.tar.gz -> runs/gpu (state) and results/bench (registered)
        PY="$VENV/bin/python"; [[ -x "$PY" ]] || PY=$PYTHON
        exec "$PY" tools/gpu_pack.py "$@" ;;
    results)
        # the result files' tables (results/evidence.py): --index renders them, --stale says what
        # changed since each ran; FILE ... runs the commands those files record again, then --index
        setup_venv
        case "${1:-}" in
            --stale) exec "$VENV/bin/python" results/evidence.py stale ;;
            --index) exec "$VENV/bin/python" results/evidence.py index ;;
            "") say "name the result files to rerun, e.g. ./run.sh results results/bench/polish.json"; exit 2 ;;
        esac
        setup_fashion_mnist
        exec "$VENV/bin/python" results/evidence.py run "$@" ;;
    *)
        sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
