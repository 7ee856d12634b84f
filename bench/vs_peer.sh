#!/usr/bin/env bash
# difftrain against the Python peer (Diffusers 0.31 + Accelerate 0.32 on torch 1.13), side by side,
# interleaved: training-loop samples/s, launch to first finished update, whole-process wall time and
# final loss, for the tiny UNet of ../shared/refstack/accel_train_min.py and difftrain's built-in
# Fashion-MNIST model, in the layouts 1 process x 2 threads and 2 processes x 1 thread, plus
# difftrain bf16 where the CPU has avx512_bf16 (issue 22; figures go into docs/PERFORMANCE.md).
#
#   bash bench/vs_peer.sh [--rounds 3] [--steps 20] [--difftrain PATH] [--json OUT.json]
#   bash bench/vs_peer.sh --quick          # smoke test: 1 round, 6 updates, 1x2 only
#   bash bench/vs_peer.sh --help           # all options (workloads, layouts, timeout, ...)
#
# DIFFTRAIN (env) or --difftrain: the binary (default build/bin/difftrain). This wrapper only sets
# the peer up: the repo's sibling shared/refstack (its env.sh; `bash ../shared/refstack/setup` once
# if torch/diffusers/accelerate do not import), then runs bench/py/vs_peer.py under /usr/bin/python3.
# Exit: 0 done, 1 a run failed (the message names it and its log), 2 the peer cannot run / bad args.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
driver="$repo/bench/py/vs_peer.py"
for arg in "$@"; do
  case "$arg" in -h|--help) exec /usr/bin/python3 "$driver" --help ;; esac
done

refstack="$(cd "$repo/.." && pwd)/shared/refstack"
cannot() { echo "vs_peer: the Python peer cannot run: $*" >&2; exit 2; }
[[ -x /usr/bin/python3 ]] || cannot "/usr/bin/python3 is missing (the peer is Debian 12's python3 + python3-torch; apt install python3)"
[[ -f "$refstack/env.sh" && -f "$refstack/accel_train_min.py" ]] ||
  cannot "$refstack (the repo's sibling shared/refstack, with env.sh and accel_train_min.py) is missing; put the refstack checkout there"
# shellcheck disable=SC1091
. "$refstack/env.sh"
check() { /usr/bin/python3 -c "import torch, diffusers, accelerate" >/dev/null 2>&1; }
if ! check; then
  setup_log="$(mktemp /tmp/vs_peer-setup.XXXXXX.log)"
  echo "vs_peer: torch/diffusers/accelerate do not import; running bash $refstack/setup once (log: $setup_log)"
  bash "$refstack/setup" >"$setup_log" 2>&1 || true
  check || cannot "'import torch, diffusers, accelerate' still fails after $refstack/setup (log: $setup_log; it needs root for apt-get python3-torch ...: run 'sudo bash $refstack/setup' and retry)"
fi
exec /usr/bin/python3 "$driver" --refstack "$refstack" "$@"
