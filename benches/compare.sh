#!/usr/bin/env bash
# Runs the raw-SQL limit (../shared/bench/sql-limit.sh, pgbench) and queue-bench in the same
# session, and prints queue-bench's processing rate as a ratio of the limit at B=500.
#
# usage: benches/compare.sh [JOBS] [WORKERS] [RUNS]      (defaults 20000 8 3)
# Runs queue-bench once per PostgreSQL driver (sqlx, tokio-postgres) after the limit, then on
# SQLite (a file in the temporary directory), whose ratio is also given against tokio-postgres.
# env:   SQL_LIMIT (path to sql-limit.sh), PGURL / QUEUE_TEST_PG_URL (the server)
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${1:-20000}; WORKERS=${2:-8}; RUNS=${3:-3}
LIMIT_SCRIPT=${SQL_LIMIT:-../shared/bench/sql-limit.sh}
[ -x "$LIMIT_SCRIPT" ] || [ -f "$LIMIT_SCRIPT" ] || { echo "compare: $LIMIT_SCRIPT not found (set SQL_LIMIT)" >&2; exit 1; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/queue-framework-target}"
cargo build --release -q -p benches --bin queue-bench

limits=$(JOBS=$JOBS bash "$LIMIT_SCRIPT" "1 50 500" "4 8")
echo "$limits"
previous=""
for run in sqlx tokio-postgres sqlite; do
  if [ "$run" = sqlite ]; then flags=(--backend sqlite); else flags=(--driver "$run"); fi
  bench=$("$CARGO_TARGET_DIR/release/queue-bench" --jobs "$JOBS" --workers "$WORKERS" --runs "$RUNS" "${flags[@]}")
  echo "run=$run"
  echo "$bench"
  python3 - "$limits" "$bench" "$run" "$previous" <<'PY'
import re, sys
limits, bench, run, previous = sys.argv[1:5]
b500 = [int(m) for m in re.findall(r"batch=500 clients=\d+ jobs=\d+ jobs_per_s=(\d+)", limits)]
rate = lambda text: int(re.search(r"process_jps=(\d+)", text.strip().splitlines()[-1]).group(1))
proc = rate(bench)
best = max(b500)
line = f"ratio: run={run} process_jps={proc} limit_b500_best={best} ratio={proc / best:.2f}"
if run == "sqlite" and previous:
    line += f" vs_tokio_postgres={proc / rate(previous):.2f}"
print(line)
PY
  previous=$bench
done
