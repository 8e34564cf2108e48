#!/usr/bin/env bash
# Alternated rounds of queue-bench builds under a limit that never binds. Each round runs, for
# each build in turn, an unlimited drain and a limited one on the same jobs, and prints their
# ratio; at the end each build's median ratio (with its range) and median throughputs. This
# machine's speed drifts by tens of percent within minutes, so compare builds only within one
# run, over several rounds, by the ratio to their own unlimited drain.
#
# usage: benches/limits-ab.sh ROUNDS "LIMIT FLAGS" BIN [BIN...]
#   LIMIT FLAGS  queue-bench's limit, quoted: "--limit-per-partition 1000"
#   BIN          queue-bench binaries, each built from a commit compared, in a target directory
#                of its own (a worktree of the base commit and
#                CARGO_TARGET_DIR=/var/tmp/base-target cargo build --release -p benches
#                --bin queue-bench there, then copy the binary out)
# env: BENCH_ARGS (default: three workers of 8 on 1 000 partitions, 100 000 noop jobs,
#      analyzed), QUEUE_TEST_PG_URL (the server)
set -euo pipefail
[ $# -ge 3 ] || { sed -n '8,15p' "$0" >&2; exit 2; }
ROUNDS=$1; LIMIT=$2; shift 2
ARGS=${BENCH_ARGS:---jobs 100000 --workers 8 --runs 1 --latency-jobs 1 --analyze --instances 3 --partitions 1000}
rate() {
  # shellcheck disable=SC2086 # the flags are words
  "$1" $ARGS $2 | tail -1 | grep -o 'process_jps=[0-9]*' | cut -d= -f2
}
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for round in $(seq 1 "$ROUNDS"); do
  for bin in "$@"; do
    unlimited=$(rate "$bin" "")
    limited=$(rate "$bin" "$LIMIT")
    line="round=$round build=$bin unlimited=$unlimited limited=$limited"
    echo "$line" | tee -a "$results"
  done
done
python3 - "$results" <<'PY'
import re, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    runs.setdefault(fields["build"], []).append((int(fields["unlimited"]), int(fields["limited"])))
for build, pairs in runs.items():
    ratios = [limited / unlimited for unlimited, limited in pairs]
    print(
        f"build={build} rounds={len(pairs)} ratio_median={statistics.median(ratios):.3f} "
        f"ratio_range={min(ratios):.3f}-{max(ratios):.3f} "
        f"unlimited_median={statistics.median(u for u, _ in pairs):.0f} "
        f"limited_median={statistics.median(l for _, l in pairs):.0f}"
    )
PY
