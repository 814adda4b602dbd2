#!/usr/bin/env bash
# The two final runs of bench/peers, one after the other, bounded and cheap to launch:
#
#   (a) the 50-model run: every system (plain, mlserver, ray, modelfleet, modelfleet-amqp,
#       modelfleet-fits, the labelled modelfleet-mapped row, amqp-rtt), all workloads
#       -> bench/peers/results/latest.json (and a timestamped copy)
#   (b) the 5,000-model scale variant (--scale): plain, ray, modelfleet, modelfleet-amqp
#       (on a private RabbitMQ node), MLServer only with --mlserver (its 5,000-model start
#       alone takes about 6 minutes)
#       -> bench/peers/results/latest-5000-small.json (and a timestamped copy)
#
#   bench/peers/final.sh [--mlserver] [--only-50 | --only-scale] [--no-mapped] [--smoke]
#                        [--venvs DIR] [--mf-venv DIR] [-- extra run.py arguments]
#
# --smoke: a short end-to-end check of both runs (10 s measured, 2 s warm-up, 500 models
# instead of 5,000 for (b), results to bench/peers/.cache/smoke-*.json, not results/):
# the figures mean nothing. Each run is bounded by `timeout` (its estimate x 2 + 5 min);
# the estimates come from the last full runs on the 2-core machine (see run_estimate).
# Run it on a quiet machine: the load generator shares the cores with the servers.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
mlserver=0 mapped=1 smoke=0 do50=1 doscale=1
common=(--skip-build)
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --mlserver) mlserver=1 ;;
        --no-mapped) mapped=0 ;;
        --smoke) smoke=1 ;;
        --only-50) doscale=0 ;;
        --only-scale) do50=0 ;;
        --venvs) common+=(--venvs "$2"); shift ;;
        --mf-venv) common+=(--mf-venv "$2"); PY="$2/bin/python"; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "final.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -x "$PY" ] || { echo "final.sh: no python at $PY (make the venv, or PY=..., --mf-venv)" >&2; exit 2; }

# Seconds per system, full length (measured on the 2-core machine, start-up included):
# 50 models, all three workloads; 5,000 models, zipf-32 only. Plus catalog writing
# (first run only) and the run's own set-up.
declare -A est50=([plain]=75 [mlserver]=85 [ray]=90 [modelfleet]=75 [modelfleet-amqp]=80
                  [modelfleet-fits]=75 [modelfleet-mapped]=80 [amqp-rtt]=15)
declare -A estscale=([plain]=120 [mlserver]=420 [ray]=100 [modelfleet]=80
                     [modelfleet-amqp]=100)
setup_s=60

systems50="plain,mlserver,ray,modelfleet,modelfleet-amqp,modelfleet-fits,amqp-rtt"
[ "$mapped" = 1 ] && systems50="plain,mlserver,ray,modelfleet,modelfleet-mapped,modelfleet-amqp,modelfleet-fits,amqp-rtt"
systemsscale="plain,ray,modelfleet,modelfleet-amqp"
[ "$mlserver" = 1 ] && systemsscale="plain,mlserver,ray,modelfleet,modelfleet-amqp"

run_estimate() {  # $1: systems, $2: name of the estimate table, $3: scale factor (percent)
    local total=$setup_s s
    local -n table=$2
    for s in ${1//,/ }; do total=$((total + table[$s])); done
    echo $((total * $3 / 100))
}

args50=(--only "$systems50")
argsscale=(--scale --only "$systemsscale")
[ "$mapped" = 1 ] && args50+=(--mapped)
pct=100
if [ "$smoke" = 1 ]; then
    short=(--measure-s 10 --warmup-s 2 --c1-s 2 --c32-s 3 --warm-warmup-s 1)
    args50+=("${short[@]}" --results "$HERE/.cache/smoke-50.json")
    argsscale=(--models 500 --private-rabbit on --only "$systemsscale" "${short[@]}"
               --results "$HERE/.cache/smoke-scale.json")
    pct=45
fi
e50=$(run_estimate "$systems50" est50 $pct)
escale=$(run_estimate "$systemsscale" estscale $pct)
total=0
[ "$do50" = 1 ] && total=$((total + e50))
[ "$doscale" = 1 ] && total=$((total + escale))
printf 'final.sh: %s; expected wall time %d min %02d s (50 models: ~%d s, scale: ~%d s)\n' \
    "$([ "$smoke" = 1 ] && echo 'SMOKE run, figures mean nothing' || echo 'full runs')" \
    $((total / 60)) $((total % 60)) "$([ "$do50" = 1 ] && echo "$e50" || echo 0)" \
    "$([ "$doscale" = 1 ] && echo "$escale" || echo 0)"

cd "$ROOT"
started=$(date +%s)
status=0
if [ "$do50" = 1 ]; then
    echo "final.sh: (a) $PY bench/peers/run.py ${common[*]} ${args50[*]} ${extra[*]}"
    timeout --signal=TERM --kill-after=60 $((e50 * 2 + 300)) \
        "$PY" bench/peers/run.py "${common[@]}" "${args50[@]}" "${extra[@]}" || status=$?
fi
if [ "$doscale" = 1 ]; then
    echo "final.sh: (b) $PY bench/peers/run.py ${common[*]} ${argsscale[*]} ${extra[*]}"
    timeout --signal=TERM --kill-after=60 $((escale * 2 + 300)) \
        "$PY" bench/peers/run.py "${common[@]}" "${argsscale[@]}" "${extra[@]}" || status=$?
fi
took=$(( $(date +%s) - started ))
printf 'final.sh: done in %d min %02d s (expected %d min %02d s), exit %d\n' \
    $((took / 60)) $((took % 60)) $((total / 60)) $((total % 60)) "$status"
exit "$status"
