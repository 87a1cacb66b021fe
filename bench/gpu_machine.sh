#!/usr/bin/env bash
# The device paths measured on a GPU machine in one run, most important first, into one log.
#
# Usage, from the project root on a machine with an NVIDIA GPU and torch/torchvision installed:
#     bench/gpu_machine.sh [OUT]           (default OUT: /tmp/fastload-gpu)
# Environment:
#     WHEELS=DIR   wheels installed first without an index, into SITE (default /tmp/fastload-site,
#                  put first on PYTHONPATH; a machine without a registry, whose Python may not take
#                  packages in its own site-packages): nvidia-nvimgcodec-cu13 and nvidia-nvjpeg 13.3
#                  or later, downloaded elsewhere: pip download --no-deps -d DIR --only-binary=:all:
#                  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#                  --platform manylinux2014_x86_64 nvidia-nvimgcodec-cu13==0.9.* 'nvidia-nvjpeg>=13.3'
#     DATA=ROOT    the synthetic set (default /tmp/fastload-synth: 10 classes x 1024 train
#                  images, made here, about 20 s on 16 CPUs)
#     WORKERS=N    the loaders' workers (default: the CPUs less two)
#     BUILD=0      the C extensions are built already (default: built in place first)
#     BUDGET=570   seconds for the whole run: a step that would end after it is cut to fit,
#                  one that cannot start before it is skipped (said in the log)
#     BIG=resnet50 FAST=resnet18 BATCH=256 WARMUP=30 STEPS=28: the model runs (a check of this
#                  script on a CPU: BIG=tiny FAST=tiny BATCH=16 WARMUP=2 STEPS=4 DATA=a small set)
#
# What it runs (each step bounded in time; OUT/gpu.log says what each printed, with the time):
#   1. the C extensions built in place, `python -m fastload info`, nvImageCodec's C interface;
#   2. the nvImageCodec tests (CUDA ones included: in-place images against copies);
#   3. decoding alone (bench/device_decode.py): nvImageCodec with the experimental GPU code on
#      (FASTLOAD_GPU_EXPERIMENTAL=1: in-place regions, its C interface), by default, and
#      torchvision's nvJPEG
#      (FASTLOAD_NVIMGCODEC=0); each loader thread's hand-overs of the interpreter per batch
#      (bench/handovers.py --device cuda);
#   4. bench/throughput.py --model resnet50 and resnet18 (fastload's own pipeline, decode="device",
#      decode="hybrid") with the experimental GPU code on, then the device paths by default and on
#      torchvision's decoder, and with the hardware decoder alone: images/s, share of the
#      ceiling, waiting, step ms and launch ms;
#   5. the rest of the GPU-relevant tests, if time is left.
# Every JSON record goes to OUT/records.jsonl, one line each with the run's name: two files in all.
set -u
OUT=${1:-/tmp/fastload-gpu}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
: >"$LOG"
START=$(date +%s)
CPUS=$(nproc)
WORKERS=${WORKERS:-$((CPUS > 3 ? CPUS - 2 : 1))}
DATA=${DATA:-/tmp/fastload-synth}
PY=${PYTHON:-python3}
BIG=${BIG:-resnet50}
FAST=${FAST:-resnet18}
BATCH=${BATCH:-256}
WARMUP=${WARMUP:-30}
STEPS=${STEPS:-28}

RECORDS=$OUT/records.jsonl
: >"$RECORDS"
TMPJSON=$(mktemp -d)
trap 'rm -rf "$TMPJSON"' EXIT
# keep NAME FILE: FILE's records (a JSON list) appended to records.jsonl, each with "run": NAME
keep() {
    [ -f "$2" ] && "$PY" -c "
import json, sys
for r in json.load(open(sys.argv[2])):
    print(json.dumps({'run': sys.argv[1], **r}))" "$1" "$2" >>"$RECORDS"
    return 0
}

say() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$LOG"; }
BUDGET=${BUDGET:-570}
# step SECONDS NAME COMMAND...: runs it with a time limit (cut to what is left of BUDGET), its
# output into the log; returns its exit status (124: stopped at the limit, or skipped)
step() {
    local limit=$1 name=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        say "== $name: skipped (${left} s of the ${BUDGET} s budget left)"
        return 124
    fi
    [ "$limit" -le "$left" ] || limit=$left
    say "== $name"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || say "   ($name: exit status $rc$([ $rc -eq 124 ] && echo ", stopped after ${limit} s"))"
    return $rc
}

say "fastload $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $CPUS CPUs, workers $WORKERS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1 || say "(no nvidia-smi)"
if [ -n "${WHEELS:-}" ]; then
    SITE=${SITE:-/tmp/fastload-site}
    step 120 "wheels from $WHEELS into $SITE" "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
[ "${BUILD:-1}" = 0 ] || step 180 "C extensions" "$PY" setup.py -q build_ext --inplace
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step 60 "fastload info" "$PY" -m fastload info
step 30 "nvImageCodec interfaces" "$PY" -c "
import torch
from fastload.gpu import nvimgcodec
usable, how = nvimgcodec.native_interface()
print('nvImageCodec', nvimgcodec.nvimgcodec_version(), '| C interface:', 'used,' if usable else 'not used:', how)
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
if [ ! -f "$DATA/.complete" ]; then
    step 240 "synthetic set" "$PY" -m fastload synth "$DATA" --classes 10 --per-class 1024 --val-per-class 40 --seed 0 \
        && touch "$DATA/.complete"
fi
step 150 "nvImageCodec tests" "$PY" -m pytest -q -p no:cacheprovider -n 8 --timeout 120 -rfEs \
    tests/test_nvimgcodec.py tests/test_nvimgcodec_native.py

decode() {  # decode NAME [ENV...]: decoding alone
    local name=$1
    shift
    step 120 "decoding alone: $name" env "$@" "$PY" bench/device_decode.py --data "$DATA" --batches 10 --repeat 3 \
        --batch-size "$BATCH" --workers 4 --json "$TMPJSON/decode-$name.json"
    keep "decode $name" "$TMPJSON/decode-$name.json"
}
decode experimental FASTLOAD_GPU_EXPERIMENTAL=1
decode default
# how often each loader thread lets go of the interpreter per batch (a hand-over the training
# thread pays for): compare with launch ms below
step 90 "hand-overs per batch" "$PY" bench/handovers.py --data "$DATA/train" --device cuda --batch-size "$BATCH" \
    --json "$TMPJSON/handovers.json"
keep "handovers" "$TMPJSON/handovers.json"

model() {  # model NAME MODEL BACKENDS [ENV...]: a training step fed by each backend
    local name=$1 net=$2 backends=$3
    shift 3
    step 240 "$net: $backends ($name)" env "$@" "$PY" bench/throughput.py --data "$DATA" --model "$net" \
        --backends "$backends" --workers "$WORKERS" --batch-size "$BATCH" --warmup "$WARMUP" --batches "$STEPS" --repeat 2 \
        --no-progress --json "$TMPJSON/model-$net-$name.json"
    keep "$net $name" "$TMPJSON/model-$net-$name.json"
}
model experimental "$BIG" fastload,device-decode,hybrid FASTLOAD_GPU_EXPERIMENTAL=1
model experimental "$FAST" device-decode,hybrid,fastload FASTLOAD_GPU_EXPERIMENTAL=1
model default "$BIG" device-decode
model default "$FAST" hybrid
# the hardware decoder alone: no decoding on the SMs beside the model (compare step ms)
model hardware-decoder-only "$BIG" device-decode FASTLOAD_HW_DECODER_LOAD=1.0
decode torchvision FASTLOAD_NVIMGCODEC=0

step 240 "GPU tests" "$PY" -m pytest -q -p no:cacheprovider -n 8 --timeout 120 -rfEs \
    tests/test_gpu.py tests/test_device_decode.py tests/test_hybrid.py tests/test_feeder.py tests/test_prefetch.py \
    tests/test_pinned.py tests/test_device.py
say "done"
