#!/usr/bin/env bash
# The GPU evidence in one command that stops by itself: versions, the gpu tests, the bench sized to
# the time left, then (given a checkpoint and data) the SuperGLUE runs of SmolLM2-135M-Instruct.
#
#   bench/gpu.sh OUTDIR [SECONDS] [options]        (make gpu OUT=DIR SECONDS=N ARGS="...")
#
# SECONDS (default 480) is the whole command's limit: every step runs under `timeout` and the
# last ends MARGIN (20) seconds before it. Runs with the machine's own python3 (PYTHON=...): no
# venv, no network, no package index. Writes under OUTDIR: versions.txt, capt.sha256, tests.log, bench.json,
# bench.log, glue.log (with each job's results table), glue.tar.gz (the capt run outputs, made in
# GLUE_DIR, default $TMPDIR/capt-gpu-glue, and packed into one file) and steps.txt (what ran, how long).
#
# options
#   --model DIR         the checkpoint of the SuperGLUE runs (weights/smollm2-135m-instruct); with --data
#   --data DIR          the SuperGLUE directory (CB and COPA ship in data/superglue; RTE must be there too)
#   --gguf A,B          build --model first from the GGUF in parts (weights/convert_gguf.py --gguf A,B);
#                       the gguf package may come as a wheel in .whl/ (put on PYTHONPATH)
#   --glue-seconds S    time kept for the SuperGLUE runs (default 240)
#   --glue-jobs "..."   the SuperGLUE jobs, in order: "task dtype epochs" joined by commas (default
#                       "cb fp32 50,copa fp32 50,cb bf16 50,rte fp32 3")
#   --glue-args "..."   more arguments for every capt run (the CPU check uses --max-steps 1 --seed-list 0)
#   --merge FILE        continue an earlier bench JSON (bench.py --merge): its complete groups are not run again
#   --bench-args "..."  more arguments for bench.py
#   --no-tests, --no-bench   leave a step out
#   --dry-run           print every step's command with the time it is given (each step counted as
#                       using all of it) and bench.py's plan (--dry-run); nothing is measured or trained
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage ;; esac
OUTDIR=$1; shift
SECONDS_TOTAL=480
if [ $# -ge 1 ] && [[ $1 =~ ^[0-9]+$ ]]; then SECONDS_TOTAL=$1; shift; fi
GLUE_JOBS=("cb fp32 50" "copa fp32 50" "cb bf16 50" "rte fp32 3")  # the default jobs (see 4. below)
MODEL="" DATA="" GGUF="" GLUE_SECONDS=240 GLUE_ARGS="" MERGE="" BENCH_ARGS="" TESTS=1 BENCH=1 DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --gguf) GGUF=$2; shift 2 ;;
    --glue-seconds) GLUE_SECONDS=$2; shift 2 ;;
    --glue-args) GLUE_ARGS=$2; shift 2 ;;
    --glue-jobs) IFS=, read -r -a GLUE_JOBS <<< "$2"; shift 2 ;;
    --merge) MERGE=$2; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    --no-tests) TESTS=0; shift ;;
    --no-bench) BENCH=0; shift ;;
    --dry-run) DRY=1; shift ;;
    *) echo "gpu.sh: unknown option $1" >&2; usage ;;
  esac
done

PYTHON=${PYTHON:-python3}
MARGIN=20          # seconds kept at the end: files written, the command returns in time
TESTS_SECONDS=150  # at most, for pytest -m gpu (it takes under 2 minutes on an H200)
TEST_SECONDS=60    # at most, for one of those tests (tests/conftest.py: CAPT_TEST_TIMEOUT)
CONVERT_SECONDS=60  # at most, for the GGUF -> safetensors conversion (10 s on two CPU cores)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=30 PYTHONUNBUFFERED=1
WHEEL=$(ls .whl/gguf-*.whl 2>/dev/null | head -1)
if [ -n "$WHEEL" ] && ! "$PYTHON" -c "import gguf" 2>/dev/null; then export PYTHONPATH="$PWD/$WHEEL${PYTHONPATH:+:$PYTHONPATH}"; fi
mkdir -p "$OUTDIR"
START=$(date +%s)
DEADLINE=$((START + SECONDS_TOTAL - MARGIN))
GLUE=0
if [ -n "$MODEL" ] && [ -n "$DATA" ]; then GLUE=1; fi
SPENT=0  # a dry run counts every step as taking its whole time limit
left() { echo $((DEADLINE - $(date +%s) - SPENT)); }
upto() { local l; l=$(left); echo $(( l < $1 ? l : $1 )); }  # a step's time limit: at most $1 s, never past the deadline
note() { echo "$*" | tee -a "$OUTDIR/steps.txt"; }

# The SuperGLUE runs of SmolLM2-135M-Instruct: "task dtype epochs", in priority order. The paper's
# budget (up to 50 epochs, early stopping with patience 5) except RTE, capped at 3 epochs (141 steps
# each) to fit: CB and COPA fp32, then CB in bf16 to time it against fp32, then RTE. On the first H200
# run the first three took 65, 73 and 106 s, and RTE did not fit the 240 s kept for them. Each job is one `capt run` (3 seeds) with its
# own output; a job cut short by the time limit keeps its state (continue with the same command).
GLUE_DIR=${GLUE_DIR:-${TMPDIR:-/tmp}/capt-gpu-glue}  # outside OUTDIR: many files, several folders deep
glue_command() {  # task dtype epochs -> the capt run command line
  echo "$PYTHON -m capt run --model $MODEL --data $DATA --tasks $1 --seeds 3 --dtype $2 --epochs $3 --patience 5 --out $GLUE_DIR/$1-$2 --resume $GLUE_ARGS"
}

note "gpu.sh $OUTDIR $SECONDS_TOTAL: start $(date -u +%FT%TZ), ends by itself within $((SECONDS_TOTAL - MARGIN)) s"
{
  # the copy on a lent machine may come without .git: the sha256 of capt/'s files names the code either way,
  # in C order (another locale sorts the paths differently), with each file's own sum in capt.sha256
  (export LC_ALL=C; find capt -name '*.py' -print0 | sort -z | xargs -0 sha256sum > "$OUTDIR/capt.sha256")
  echo "commit $(timeout 20 git rev-parse HEAD 2>/dev/null || echo 'unknown (no git here)')$(timeout 20 git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo +dirty)"
  echo "capt sha256 $(sha256sum < "$OUTDIR/capt.sha256" | cut -c1-64)"
  timeout -k 5 120 "$PYTHON" - <<'EOF'
import platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU")
from importlib.metadata import PackageNotFoundError, version
for name in ("triton", "transformers", "peft", "safetensors", "tokenizers", "numpy", "gguf"):
    try:
        print(name, version(name))
    except PackageNotFoundError:
        print(name, "absent")
EOF
  timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
} 2>&1 | tee "$OUTDIR/versions.txt"

# 1. the gpu tests
if [ $TESTS = 1 ]; then
  if [ $DRY = 1 ]; then
    note "tests: $PYTHON -m pytest tests/test_gpu.py -m gpu -q -rA --durations=0 (timeout $(upto $TESTS_SECONDS) s, $TEST_SECONDS s a test)"
    SPENT=$((SPENT + $(upto $TESTS_SECONDS)))
  else
    t=$(date +%s)
    # test_gpu.py alone: collecting all of tests/ would need every test extra (hypothesis, ...) on the machine
    # -rA: a line for every test, so a run cut at the limit still names what passed; CAPT_TEST_TIMEOUT: one test's limit
    CAPT_TEST_TIMEOUT=$TEST_SECONDS timeout -k 10 "$(upto $TESTS_SECONDS)" "$PYTHON" -m pytest tests/test_gpu.py -m gpu -q \
      -rA --durations=0 -p no:cacheprovider 2>&1 | tee "$OUTDIR/tests.log" | tail -25
    note "tests: exit ${PIPESTATUS[0]} (124: cut at the time limit), $(( $(date +%s) - t )) s"
  fi
fi

# 2. the checkpoint from the GGUF in parts
if [ -n "$GGUF" ] && [ -n "$MODEL" ]; then
  if [ $DRY = 1 ]; then
    note "convert: $PYTHON weights/convert_gguf.py --gguf $GGUF --out $MODEL (timeout $(upto $CONVERT_SECONDS) s)"
    SPENT=$((SPENT + $(upto $CONVERT_SECONDS)))
  else
    t=$(date +%s)
    timeout -k 5 "$(upto $CONVERT_SECONDS)" "$PYTHON" weights/convert_gguf.py --gguf "$GGUF" --out "$MODEL" 2>&1 | tail -3
    note "convert: exit ${PIPESTATUS[0]}, $(( $(date +%s) - t )) s"
  fi
fi

# 3. the bench, sized to what is left once the SuperGLUE runs have their time
if [ $BENCH = 1 ]; then
  keep=$(( GLUE ? GLUE_SECONDS : 0 ))
  budget=$(( $(left) - keep ))
  bench=(bench/bench.py --budget "$budget" --out "$OUTDIR/bench.json")
  [ -n "$MERGE" ] && bench+=(--merge "$MERGE")
  # shellcheck disable=SC2206
  bench+=($BENCH_ARGS)
  if [ $budget -lt 30 ]; then
    note "bench: skipped, $budget s left after keeping $keep s for the SuperGLUE runs"
  elif [ $DRY = 1 ]; then
    note "bench: $PYTHON ${bench[*]} (timeout $((budget + 5)) s)"
    timeout -k 5 120 "$PYTHON" "${bench[@]}" --dry-run 2>&1 | tee "$OUTDIR/bench-plan.txt"
    SPENT=$((SPENT + budget))
  else
    t=$(date +%s)
    timeout -k 10 $((budget + 5)) "$PYTHON" "${bench[@]}" 2>&1 | tee "$OUTDIR/bench.log" | sed -n '/^x plain/,$p'
    note "bench: exit ${PIPESTATUS[0]}, $(( $(date +%s) - t )) s of a $budget s budget"
  fi
fi

# 4. the SuperGLUE runs
if [ $GLUE = 1 ]; then
  for job in "${GLUE_JOBS[@]}"; do
    # shellcheck disable=SC2086
    set -- $job
    command=$(glue_command "$@")
    if [ $DRY = 1 ]; then
      note "glue: $command (timeout: the $(left) s left)"
      continue
    fi
    if [ "$(left)" -lt 30 ]; then
      note "glue $1 $2: not started, $(left) s left"
      continue
    fi
    t=$(date +%s)
    echo "== $command" >> "$OUTDIR/glue.log"
    # shellcheck disable=SC2086
    timeout -s TERM -k 15 "$(left)" $command >> "$OUTDIR/glue.log" 2>&1
    code=$?
    note "glue $1 $2 ($3 epochs at most): exit $code, $(( $(date +%s) - t )) s"
    [ -f "$GLUE_DIR/$1-$2/results.md" ] && grep '^| ' "$GLUE_DIR/$1-$2/results.md" | tee -a "$OUTDIR/glue.log"
  done
  if [ $DRY = 0 ] && [ -d "$GLUE_DIR" ]; then  # one file under OUTDIR: the outputs without training states
    tar -czf "$OUTDIR/glue.tar.gz" -C "$GLUE_DIR" --exclude=state.pt --exclude=.lock . && note "glue: packed into glue.tar.gz"
  fi
fi
note "gpu.sh: done in $(( $(date +%s) - START )) s of $SECONDS_TOTAL"
