#!/usr/bin/env bash
# benchmarks/gpu_suite.sh: the GPU-only tests and the GPU benchmarks, in one JSON file.
#
# Parts, in order, each with its own timeout inside one time budget (default 600 s, so the
# whole suite stays within 10 minutes on one H200); a part that fails or times out is recorded
# in the JSON with the tail of its log, and the suite goes on; a part the budget no longer
# fits is recorded as skipped. The figures that only a GPU can give come first (GPT-2's
# stack and its levers, float8, the memory estimate against the allocator); --only runs the
# parts it names in the order it names them:
#
#   environment     accelfn doctor (versions, driver, GPU, settings)
#   gpt2            benchmarks/gpt2.py: GPT-2 small tokens/s, MFU, memory, stage ratios,
#                   the levers of the recommended stack and its hand-written twin
#   captured        benchmarks/captured.py: the captured step against eager and the hand
#                   loop on a launch-bound GPT (256 wide, 4 layers, batch 8) and on GPT-2
#                   small compiled; fp32 equality of captured and eager
#   float8          benchmarks/float8.py: float8 against bf16 tokens/s on GPTs 4096 and 2048
#                   wide; a per-shape sweep of one Linear (where float8 wins)
#   memory          benchmarks/memory.py --device cuda: estimate_memory's peak against
#                   torch.cuda.max_memory_allocated for a 58.8M GPT, GPT-2 small and
#                   ResNet-50 (within 10%), the logits' peak with linear_cross_entropy,
#                   adaptive accumulation's count
#   gpu_tests       the GPU-only tests (marked gpu, or skipped without CUDA): pytest -p gpu_only
#   bench_resnet50  accelfn bench --model resnet50: images/s, MFU and ratio of the stages
#                   (DataLoader baseline, accelfn data, AMP, compile with channels_last;
#                   every stage in a dry run)
#   transforms      benchmarks/transforms.py: compiled against eager, the cold compile and
#                   the warm cache on a restart (on a GPU; AMP, accumulation and
#                   checkpointing too in a dry run)
#   data            benchmarks/data.py: accelfn.data against DataLoader, to the GPU; real
#                   JPEGs decoded on the GPU against ImageFolder + PIL in workers
#   sharded_muon    benchmarks/sharded_muon.py --device cuda: sharded Muon's optimizer step
#                   against AdamW's under FSDP2 (NCCL, one process per GPU, up to 4)
#   compile         benchmarks/compile.py --only regional: regional (in place) and nested
#                   against whole-model cold compile and steady step on GPT-2 small (last:
#                   measured before, its figures do not move with the others)
#
# Usage:
#   benchmarks/gpu_suite.sh                    # on a GPU: benchmarks/results/gpu-<date>.json
#   benchmarks/gpu_suite.sh --dry-run          # every part, tiny, on the CPU (checks the suite)
#   benchmarks/gpu_suite.sh --out PATH --budget SECONDS --only gpt2,bench_resnet50
#   benchmarks/gpu_suite.sh --keep DIR         # also keep every part's log and JSON in DIR
#
# Environment: PYTHON (default .venv/bin/python, else python3), SUITE_BUDGET_S.
set -euo pipefail

usage() {
  sed -n '2,44p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DRY_RUN=0
OUT=""
BUDGET="${SUITE_BUDGET_S:-}"
ONLY=""
KEEP=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --keep) KEEP="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

PARTS=(environment gpt2 captured float8 memory gpu_tests bench_resnet50 transforms data
       sharded_muon compile)
ORDER=("${PARTS[@]}")
if [[ -n "$ONLY" ]]; then
  IFS=, read -ra ORDER <<< "$ONLY"
  for name in "${ORDER[@]}"; do
    if [[ " ${PARTS[*]} " != *" $name "* ]]; then
      echo "gpu_suite.sh: --only names an unknown part '$name'; the parts are: ${PARTS[*]}" >&2
      exit 2
    fi
  done
fi
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
if [[ $DRY_RUN -eq 1 ]]; then
  BUDGET="${BUDGET:-1200}"
  OUT="${OUT:-${TMPDIR:-/tmp}/accelfn-gpu-suite-dry-run-$STAMP.json}"
else
  BUDGET="${BUDGET:-600}"
  OUT="${OUT:-benchmarks/results/gpu-$STAMP.json}"
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/accelfn-gpu-suite.XXXXXX")"
keep_work() {
  if [[ -n "$KEEP" ]]; then mkdir -p "$KEEP" && cp -r "$WORK"/. "$KEEP"/ || true; fi
  rm -rf "$WORK"
}
trap keep_work EXIT
START_S=$SECONDS
: > "$WORK/parts.tsv"

selected() { [[ -z "$ONLY" || ",$ONLY," == *",$1,"* ]]; }

# run_part NAME TIMEOUT [--stdout-json] CMD...: run CMD under a timeout (shortened to what is
# left of the budget); output to $WORK/NAME.log (with --stdout-json, stdout to NAME.json);
# the exit status and seconds go to parts.tsv. A failure is recorded, never fatal.
run_part() {
  local name="$1" limit="$2"; shift 2
  local to_json=0
  if [[ "${1:-}" == "--stdout-json" ]]; then to_json=1; shift; fi
  if ! selected "$name"; then return 0; fi
  local left=$(( BUDGET - (SECONDS - START_S) ))
  # A part that would get under half its timeout is skipped rather than cut short: it would
  # likely time out, and the time is better left to a later --only run of it.
  if (( left < 15 || left * 2 < limit )); then
    printf '%s\t0\t0\tskipped: %ss of the suite budget of %ss left, under half its %ss\n' \
      "$name" "$left" "$BUDGET" "$limit" >> "$WORK/parts.tsv"
    echo "[gpu-suite] $name: skipped (${left}s of the budget left, under half its ${limit}s)"
    return 0
  fi
  if (( limit > left )); then limit=$left; fi
  echo "[gpu-suite] $name (timeout ${limit}s): $*"
  local t0=$SECONDS rc=0
  if [[ $to_json -eq 1 ]]; then
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.json" 2> "$WORK/$name.log" || rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1 || rc=$?
  fi
  printf '%s\t%d\t%d\t\n' "$name" "$rc" "$(( SECONDS - t0 ))" >> "$WORK/parts.tsv"
  echo "[gpu-suite] $name: exit $rc after $(( SECONDS - t0 ))s"
  tail -n 4 "$WORK/$name.log" | sed 's/^/    /' || true
}

if [[ $DRY_RUN -eq 1 ]]; then
  echo "[gpu-suite] dry run: every part, tiny, on the CPU (budget ${BUDGET}s)"
  DEV=(--device cpu)
  # The tiny CNN stands in for ResNet-50 (same harness); compile runs with the 'eager'
  # backend, which traces without generating code: the suite's paths in seconds.
  BENCH=(--quick --model cnn --batch-size 8 --steps 2 --warmup 1 --overhead-steps 3
         --compile --compile-backend eager)
  GPT=(--tiny --compile --compile-backend eager --batches 8,4)
  TRANSFORMS=(--quick --steps 2 --compile --compile-backend eager)
  DATA=(--samples 1024 --batch-size 128 --repeats 1 --workers 1 --parts preloaded,jpeg --dry-run)
  # the depth sweep too: its fresh processes are checked here (the suite's own tests stand
  # them in with known costs)
  COMPILE=(--quick --backend eager --steps 3 --only regional,depth --depths 2,3)
  FLOAT8=(--dry-run --shapes)
  MEMORY=(--tiny --rounds 2 --device cpu --anchors)
  MUON=(--tiny --rounds 1 --steps 1 --nproc 2 --device cpu)
  CAPTURED=(--dry-run); T_CAPTURED=120
  T_FLOAT8=240; T_COMPILE=240; T_MEMORY=120; T_MUON=180
  T_TESTS=180; T_BENCH=240; T_GPT=240; T_TRANSFORMS=240; T_DATA=120  # a loaded CI machine
else
  if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "[gpu-suite] no CUDA GPU here; use --dry-run to check the suite on a CPU" >&2
  fi
  DEV=()
  # ResNet-50: one compiled stage (channels_last, which the target is about) keeps it in
  # budget; the DDP stage needs several GPUs.
  BENCH=(--model resnet50 --steps 20 --warmup 3 --overhead-steps 20
         --stages baseline,dataloader_tuned,accelfn_data,amp,channels_last)
  # the levers of the recommended stack, each against the stage before, and its hand-written
  # twin (checkpointed's memory against time does not change with them: left out)
  GPT=(--stages baseline,accelfn_fp32,amp,compiled,chunked_ce,sdpa,batch,hand)
  TRANSFORMS=(--only compile)
  DATA=(--parts preloaded,jpeg --samples 20000 --repeats 3 --jpeg-images 5000)
  COMPILE=(--only regional --steps 20)  # three cold compiles, six interleaved sides
  FLOAT8=(--widths 4096,2048 --shapes --budget-s 60)
  MEMORY=(--rounds 5 --device cuda --anchors)
  MUON=(--rounds 3 --steps 2 --device cuda)
  CAPTURED=(--device cuda); T_CAPTURED=180
  T_FLOAT8=300; T_COMPILE=180; T_MEMORY=150; T_MUON=90
  T_TESTS=90; T_BENCH=200; T_GPT=300; T_TRANSFORMS=120; T_DATA=120
fi

part_environment() {
  run_part environment 60 "$PYTHON" -c \
    'import sys; from accelfn.observe.environment import doctor; open(sys.argv[1], "w").write(doctor().to_json())' \
    "$WORK/environment.json"
}

part_gpt2() {
  run_part gpt2 "$T_GPT" "$PYTHON" benchmarks/gpt2.py "${GPT[@]}" "${DEV[@]}" \
    --json "$WORK/gpt2.json"
}

part_captured() {
  run_part captured "$T_CAPTURED" --stdout-json "$PYTHON" benchmarks/captured.py "${CAPTURED[@]}"
}

part_float8() {
  run_part float8 "$T_FLOAT8" --stdout-json "$PYTHON" benchmarks/float8.py "${FLOAT8[@]}"
}

part_memory() {
  run_part memory "$T_MEMORY" "$PYTHON" benchmarks/memory.py "${MEMORY[@]}" \
    --out "$WORK/memory.json"
}

part_gpu_tests() {
  # Only files that mention CUDA or a GPU can hold GPU-only tests: collect just those (faster);
  # the gpu_only plugin then keeps the GPU-only tests among them. Tests sit in tests/<package>/.
  mapfile -t GPU_FILES < <(grep -rlEi --include='test_*.py' 'cuda|gpu' tests \
    | grep -v 'test_bench.py' | sort || true)
  if [[ ${#GPU_FILES[@]} -gt 0 ]]; then
    run_part gpu_tests "$T_TESTS" env PYTHONPATH="$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}" \
      "$PYTHON" -m pytest -p gpu_only "${GPU_FILES[@]}" -q -rs -p no:cacheprovider \
      --junitxml "$WORK/gpu_tests.xml"
  elif selected gpu_tests; then
    printf 'gpu_tests\t0\t0\tskipped: no test file mentions CUDA or a GPU\n' >> "$WORK/parts.tsv"
  fi
}

part_bench_resnet50() {
  run_part bench_resnet50 "$T_BENCH" "$PYTHON" -m accelfn.cli.bench "${BENCH[@]}" "${DEV[@]}" \
    --json "$WORK/bench_resnet50.json"
}

part_transforms() {
  run_part transforms "$T_TRANSFORMS" "$PYTHON" benchmarks/transforms.py "${TRANSFORMS[@]}" \
    "${DEV[@]}" --json "$WORK/transforms.json"
}

part_data() {
  run_part data "$T_DATA" --stdout-json "$PYTHON" benchmarks/data.py "${DATA[@]}" "${DEV[@]}"
}

part_sharded_muon() {
  run_part sharded_muon "$T_MUON" "$PYTHON" benchmarks/sharded_muon.py "${MUON[@]}" \
    --out "$WORK/sharded_muon.json"
}

part_compile() {
  run_part compile "$T_COMPILE" "$PYTHON" benchmarks/compile.py "${COMPILE[@]}" \
    "${DEV[@]}" --json "$WORK/compile.json"
}

for name in "${ORDER[@]}"; do "part_$name"; done

REPORT=(--work "$WORK" --out "$OUT" --budget "$BUDGET" --started "$STARTED"
        --seconds "$(( SECONDS - START_S ))")
if [[ $DRY_RUN -eq 1 ]]; then REPORT+=(--dry-run); fi
"$PYTHON" benchmarks/suite_report.py "${REPORT[@]}"

# Exit 1 when a part failed or timed out (the JSON says which and why), 0 otherwise.
if awk -F'\t' '$4 !~ /^skipped/ && $2 != 0 && !($1 == "gpu_tests" && $2 == 5) {bad=1}
               END {exit bad ? 0 : 1}' "$WORK/parts.tsv"; then
  exit 1
fi
exit 0
