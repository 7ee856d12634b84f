#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time: replays every committed input of CORPUS (the seeds
# and the regression inputs of crashes found earlier), then fuzzes for SECONDS. New inputs go to a
# scratch directory, so the committed corpus is never modified; a crash leaves its input in
# ARTIFACTS/ and fails the test.
# usage: run_fuzz.sh FUZZER CORPUS SECONDS ARTIFACTS [extra libFuzzer flags]
set -euo pipefail
fuzzer=$1 corpus=$2 seconds=$3 artifacts=$4
shift 4
mkdir -p "$artifacts"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:detect_container_overflow=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:suppressions=$(dirname "$0")/ubsan.supp}
# A fixed seed (DIFFTRAIN_FUZZ_SEED, default 1): the suite replays the same mutations every run,
# so a CI result does not depend on luck; longer runs pick other seeds.
exec "$fuzzer" -seed="${DIFFTRAIN_FUZZ_SEED:-1}" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$artifacts/$(basename "$fuzzer")-" "$@" "$scratch" "$corpus"
