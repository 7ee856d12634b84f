#!/usr/bin/env bash
# Two machines on one host: two network namespaces joined by a veth pair, each with its own
# address, one `difftrain launch` in each.
#   1. the two launchers form one 4-rank group and every collective check passes;
#   2. the link goes down in the middle of a job: both sides must end with an error that names
#      the lost rank, within the collective timeout plus a few seconds, never hang;
#   3. a rank given an address where nobody answers ends with a clear error within its join
#      timeout. (All traffic stays on the veth pair between the two namespaces.)
# Needs root and `ip netns` (CI runs as root); exits 77 (ctest: skipped) where they are missing.
set -u
difftrain=$1
worker=$2

if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null; then
  echo "netns test needs root and iproute2"; exit 77
fi
id=$$
ns0=dt${id}m0; ns1=dt${id}m1; veth0=dt${id}a; veth1=dt${id}b
addr0=10.213.7.1; addr1=10.213.7.2
work=$(mktemp -d /tmp/difftrain-netns-XXXXXX)
export XDG_CACHE_HOME=$work/cache

cleanup() {
  jobs -p | xargs -r kill -9 2>/dev/null
  ip netns del "$ns0" 2>/dev/null
  ip netns del "$ns1" 2>/dev/null
  ip link del "$veth0" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

if ! ip netns add "$ns0" 2>"$work/netns.err"; then
  echo "ip netns does not work here: $(cat "$work/netns.err")"; exit 77
fi
set -e
ip netns add "$ns1"
ip link add "$veth0" type veth peer name "$veth1"
ip link set "$veth0" netns "$ns0"
ip link set "$veth1" netns "$ns1"
ip -n "$ns0" addr add "$addr0/24" dev "$veth0"
ip -n "$ns1" addr add "$addr1/24" dev "$veth1"
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
ip -n "$ns0" link set "$veth0" up
ip -n "$ns1" link set "$veth1" up
set +e

fail() {
  echo "FAIL: $*"
  for f in "$work"/*.out "$work"/*.err; do echo "=== $f"; cat "$f"; done
  exit 1
}

# Starts machine $1 of a 2-machine job in its namespace: launch flags..., then the program.
machine() {
  local rank=$1 ns=$2; shift 2
  ip netns exec "$ns" timeout 120 "$difftrain" launch --num_machines 2 --machine_rank "$rank" \
    --main_process_ip "$addr0" --main_process_port 29611 --join_timeout 20 "$@"
}

echo "--- 1. one 4-rank group over two namespaces"
machine 0 "$ns0" --num_processes 4 "$worker" collectives >"$work/ok0.out" 2>"$work/ok0.err" &
p0=$!
machine 1 "$ns1" --num_processes 4 "$worker" collectives >"$work/ok1.out" 2>"$work/ok1.err" &
p1=$!
wait $p0; s0=$?
wait $p1; s1=$?
[ $s0 -eq 0 ] && [ $s1 -eq 0 ] || fail "launchers exited $s0 and $s1"
grep -q "\[rank 0\] difftrain test: 11 passed, 0 failed on 4 rank(s)" "$work/ok0.out" || fail "no pass line"
grep -q "rendezvous $addr0:29611" "$work/ok0.out" || fail "rank 0 did not use the TCP rendezvous at $addr0"
grep -q "\[FAIL\]" "$work/ok0.out" "$work/ok1.out" && fail "a check failed"
echo "ok"

echo "--- 2. the link goes down mid-job"
export DIFFTRAIN_COLLECTIVE_TIMEOUT=5 DIFFTRAIN_JOIN_TIMEOUT=8
machine 0 "$ns0" --num_processes 2 "$worker" loop 100 >"$work/cut0.out" 2>"$work/cut0.err" &
p0=$!
machine 1 "$ns1" --num_processes 2 "$worker" loop 100 >"$work/cut1.out" 2>"$work/cut1.err" &
p1=$!
for _ in $(seq 1 300); do
  grep -q "iteration 40" "$work/cut0.out" 2>/dev/null && break
  sleep 0.1
done
grep -q "iteration 40" "$work/cut0.out" || fail "the job did not get going"
start=$(date +%s)
ip -n "$ns1" link set "$veth1" down
wait $p0; s0=$?
wait $p1; s1=$?
took=$(( $(date +%s) - start ))
echo "launchers exited $s0 and $s1, ${took}s after the link went down"
[ $s0 -ne 0 ] && [ $s1 -ne 0 ] || fail "a launcher exited 0 after losing its peer"
[ $s0 -ne 124 ] && [ $s1 -ne 124 ] || fail "a launcher hung until timeout(1) killed it"
[ $took -le 45 ] || fail "took ${took}s to notice the lost link"
grep -q "lost rank(s) 1" "$work/cut0.err" || fail "machine 0 did not name the lost rank 1"
grep -q "lost rank(s) 0" "$work/cut1.err" || fail "machine 1 did not name the lost rank 0"
grep -h "lost rank" "$work/cut0.err" "$work/cut1.err"
echo "ok"
echo "--- 3. a rendezvous address nobody answers on (inside the namespaces' own subnet)"
unset DIFFTRAIN_COLLECTIVE_TIMEOUT
ip -n "$ns1" link set "$veth1" up
start=$(date +%s)
ip netns exec "$ns1" env RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.213.7.99 MASTER_PORT=29612 \
  DIFFTRAIN_JOIN_TIMEOUT=3 timeout 60 "$worker" collectives >"$work/none.out" 2>"$work/none.err"
s=$?
took=$(( $(date +%s) - start ))
[ $s -eq 1 ] || fail "exit $s for an unreachable rendezvous address"
[ $took -le 15 ] || fail "took ${took}s to give up on an unreachable address (join timeout 3 s)"
grep -q "rank 1/2 could not reach the rendezvous at 10.213.7.99:29612 within 3 s" "$work/none.err" ||
  fail "no clear error for an unreachable address"
echo "ok (${took}s)"
echo "netns two-machine test: 3 passed, 0 failed"
