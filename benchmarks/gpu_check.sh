#!/usr/bin/env bash
# GPU check for sparkdist: the GPU-only tests and both launch-mode examples at small GPU sizes,
# in under 10 minutes (step limits 240 + 120 + 120 s, plus set-up), with a short report.
#
#   bash benchmarks/gpu_check.sh [REPORT_DIR]      # default: $OUT, else ./gpu-check-report
#
# Runs, one after the other, each under its own time limit:
#   1. pytest -m gpu                    NCCL + device binding, FSDP2 bf16, DeepSpeed ZeRO-2 bf16
#   2. examples/fsdp_transformer.py     the ~10M-parameter default model, FSDP2, bf16
#   3. examples/deepspeed_zero.py       ZeRO-2 from conf/deepspeed/zero2.json plus bf16
# and writes REPORT_DIR/report.md (pass/fail, seconds, final losses, nvidia-smi summary,
# versions), report.json, and one log per step. Exits non-zero if any step failed.
#
# Python: $SPARKDIST_PYTHON if set, else ./.venv (created when missing, with
# --system-site-packages so a CUDA torch already on the machine is used, and sparkdist installed
# editable into it). It needs torch with CUDA, deepspeed, pytest, pytest-timeout and psutil; an
# offline machine must already have them (the report says what is missing).
# Knobs: GPU_CHECK_PROCESSES (default: min(2, GPUs)), GPU_CHECK_STEPS (default 100).

set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPORT_DIR="${1:-${OUT:-$REPO/gpu-check-report}}"
mkdir -p "$REPORT_DIR"
REPORT_DIR="$(cd "$REPORT_DIR" && pwd)"
cd "$REPO" || exit 2
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
export PYTHONUNBUFFERED=1

STARTED=$SECONDS
STEPS=()     # "name|PASS or FAIL|seconds|detail"
log() {
    printf '[gpu_check %4ds] %s\n' "$((SECONDS - STARTED))" "$*" \
        | tee -a "$REPORT_DIR/gpu_check.log"
}

# -- environment -----------------------------------------------------------------------------

setup_python() {
    if [[ -n "${SPARKDIST_PYTHON:-}" ]]; then
        PY="$SPARKDIST_PYTHON"
        return
    fi
    if [[ ! -x .venv/bin/python ]]; then
        log "creating .venv (--system-site-packages: reuse the machine's CUDA torch)"
        python3 -m venv --system-site-packages .venv || return 1
    fi
    PY="$REPO/.venv/bin/python"
    if ! "$PY" -c "import sparkdist" 2>/dev/null; then
        log "installing sparkdist (editable) into .venv"
        # No build isolation: an offline machine cannot download setuptools into a build env.
        "$PY" -m pip install -q --no-build-isolation -e "$REPO" >>"$REPORT_DIR/setup.log" 2>&1 \
            || "$PY" -m pip install -q -e "$REPO" >>"$REPORT_DIR/setup.log" 2>&1
    fi
    local missing
    missing="$("$PY" - <<'EOF'
import importlib.util
names = {"torch": "torch", "deepspeed": "deepspeed", "pytest": "pytest",
         "pytest_timeout": "pytest-timeout", "psutil": "psutil", "cloudpickle": "cloudpickle"}
print(" ".join(pip for mod, pip in names.items() if importlib.util.find_spec(mod) is None))
EOF
)"
    if [[ -n "$missing" ]]; then
        log "installing missing packages: $missing"
        # shellcheck disable=SC2086 # one word per package
        "$PY" -m pip install -q $missing >>"$REPORT_DIR/setup.log" 2>&1 \
            || log "could not install: $missing (offline?); see setup.log"
    fi
}

# -- steps -----------------------------------------------------------------------------------

# run_step NAME LIMIT_S LOGFILE COMMAND...: run with a time limit, record PASS/FAIL and seconds.
run_step() {
    local name="$1" limit="$2" logfile="$3"
    shift 3
    log "$name: $* (limit ${limit}s)"
    local began=$SECONDS code
    timeout --kill-after=15 "$limit" "$@" >"$logfile" 2>&1
    code=$?
    local took=$((SECONDS - began)) result=PASS
    [[ $code -eq 0 ]] || result=FAIL
    [[ $code -eq 124 || $code -eq 137 ]] && result="FAIL (timed out after ${limit}s)"
    STEP_RESULT="$result"
    STEP_SECONDS=$took
    log "$name: $result in ${took}s"
}

record() { STEPS+=("$1|$STEP_RESULT|$STEP_SECONDS|$2"); }

final_loss() { grep -o 'final loss [0-9.]*' "$1" | tail -1 | awk '{print $3}'; }

main() {
    log "report dir: $REPORT_DIR"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi >"$REPORT_DIR/nvidia-smi.txt" 2>&1
        GPU_SUMMARY="$(nvidia-smi --query-gpu=index,name,memory.total,driver_version \
            --format=csv,noheader 2>&1)"
    else
        GPU_SUMMARY="nvidia-smi not found"
    fi
    log "GPUs: ${GPU_SUMMARY//$'\n'/; }"

    if ! setup_python; then
        STEP_RESULT="FAIL"; STEP_SECONDS=$((SECONDS - STARTED)); record "environment" "no venv"
        write_report; return 1
    fi
    VERSIONS="$("$PY" - 2>/dev/null <<'EOF'
import importlib, platform
parts = [f"python {platform.python_version()}"]
for name in ("torch", "deepspeed", "pyspark", "sparkdist"):
    try:
        parts.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception as exc:  # noqa: BLE001 - report whatever is wrong
        parts.append(f"{name} missing ({type(exc).__name__})")
try:
    import torch

    cuda = torch.cuda.is_available()
    parts.append(f"CUDA {torch.version.cuda}, available={cuda}, devices="
                 f"{torch.cuda.device_count()}, bf16={cuda and torch.cuda.is_bf16_supported()}")
except Exception as exc:  # noqa: BLE001
    parts.append(f"torch.cuda unusable ({exc})")
print("; ".join(parts))
EOF
)"
    VERSIONS="${VERSIONS##*$'\n'}"  # the last line: deepspeed may log on stdout first
    log "versions: $VERSIONS"
    if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        STEP_RESULT="FAIL"; STEP_SECONDS=0
        record "environment" "torch sees no CUDA device (CPU build of torch, or no GPU)"
        write_report; return 1
    fi

    # A torch extension build killed half-way leaves its lock, and every later load of that op
    # (DeepSpeed's) waits on it forever: say so up front instead of timing out without a clue.
    local locks
    locks="$(find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock 2>/dev/null)"
    if [[ -n "$locks" ]]; then
        log "WARNING: torch extension lock(s) left by an interrupted build (delete them if no"
        log "build is running, or DeepSpeed will wait on them forever): ${locks//$'\n'/ }"
        STALE_LOCKS="$locks"
    fi

    # One rank per GPU, at most 2 (what torch sees: nvidia-smi may be missing or masked).
    local processes="${GPU_CHECK_PROCESSES:-$("$PY" -c \
        "import torch; print(min(2, torch.cuda.device_count()))" 2>/dev/null)}"
    local steps="${GPU_CHECK_STEPS:-100}"

    run_step "pytest -m gpu" 240 "$REPORT_DIR/pytest.log" \
        "$PY" -m pytest -m gpu tests -v -rs -p no:cacheprovider \
        --junitxml="$REPORT_DIR/pytest-gpu.xml"
    record "pytest -m gpu" "$(grep -Eo '[0-9]+ (passed|failed|skipped|error)[^=]*' \
        "$REPORT_DIR/pytest.log" | tail -1)"

    run_step "fsdp_transformer.py" 120 "$REPORT_DIR/fsdp_transformer.log" \
        "$PY" examples/fsdp_transformer.py --processes "$processes" --steps "$steps"
    record "fsdp_transformer.py ($processes GPU, ~10M params, bf16)" \
        "final loss $(final_loss "$REPORT_DIR/fsdp_transformer.log")"

    # zero2.json as shipped plus bf16; torch's AdamW so that nothing is compiled with nvcc.
    "$PY" - "$REPO/conf/deepspeed/zero2.json" "$REPORT_DIR/zero2_bf16.json" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["bf16"] = {"enabled": True}
config["optimizer"]["params"]["torch_adam"] = True
json.dump(config, open(sys.argv[2], "w"), indent=2)
EOF
    run_step "deepspeed_zero.py" 120 "$REPORT_DIR/deepspeed_zero.log" \
        "$PY" examples/deepspeed_zero.py --processes "$processes" --steps "$steps" \
        --config "$REPORT_DIR/zero2_bf16.json"
    record "deepspeed_zero.py ($processes GPU, ZeRO-2, bf16)" \
        "final loss $(final_loss "$REPORT_DIR/deepspeed_zero.log")"

    write_report
    local step
    for step in "${STEPS[@]}"; do
        [[ "$step" == *"|PASS|"* ]] || return 1
    done
}

write_report() {
    local overall=PASS step name result seconds detail
    for step in "${STEPS[@]}"; do
        [[ "$step" == *"|PASS|"* ]] || overall=FAIL
    done
    {
        echo "# sparkdist GPU check: $overall"
        echo
        echo "$(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $((SECONDS - STARTED)) s in all"
        echo
        echo "| step | result | seconds | detail |"
        echo "| --- | --- | --- | --- |"
        for step in "${STEPS[@]}"; do
            IFS='|' read -r name result seconds detail <<<"$step"
            echo "| $name | $result | $seconds | $detail |"
        done
        echo
        echo "GPUs (nvidia-smi): "
        echo '```'
        echo "${GPU_SUMMARY:-unknown}"
        echo '```'
        echo "Versions: ${VERSIONS:-unknown}"
        echo
        [[ -z "${STALE_LOCKS:-}" ]] || echo "Torch extension locks found at the start: $STALE_LOCKS"
        echo "Logs: pytest.log, fsdp_transformer.log, deepspeed_zero.log, nvidia-smi.txt"
    } >"$REPORT_DIR/report.md"
    {
        printf '{"result": "%s", "seconds": %d, "steps": [' "$overall" "$((SECONDS - STARTED))"
        local first=1
        for step in "${STEPS[@]}"; do
            IFS='|' read -r name result seconds detail <<<"$step"
            [[ $first -eq 1 ]] || printf ', '
            first=0
            printf '{"name": "%s", "result": "%s", "seconds": %s, "detail": "%s"}' \
                "${name//\"/\'}" "$result" "$seconds" "${detail//\"/\'}"
        done
        printf ']}\n'
    } >"$REPORT_DIR/report.json"
    cat "$REPORT_DIR/report.md"
}

main
