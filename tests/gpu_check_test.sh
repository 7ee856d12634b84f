#!/usr/bin/env bash
# scripts/gpu_check, in a throwaway git repository with a fake layout: pack hides exactly the
# goldens the GPU machine does not need from what git lists (and nothing else), touching no
# work-tree file; the size check refuses above GPU_CHECK_LIMIT_MIB and unpacks itself; unpack puts
# back `git ls-files -s`, `git diff --cached`, `git status --porcelain` and .git/info/exclude
# exactly (also when .git/info did not exist, and keeping a `git add` made while packed); a second
# unpack does nothing; packing twice is refused; a commit made while packed loses nothing (the
# hidden files are staged again); the device verb's stage runner (SMOKE=1) writes its logs and
# summary and stops at a failing stage; rehearse runs end to end and leaves git as it was, also
# when its device run fails. Then scripts/lib/apt_mirror.sh's debian_mirror on fake apt sources
# (deb822 and one-line, options, disabled stanzas, suites that are not a Debian release,
# Ubuntu-only sources), and that no script names Debian's host.
#   bash tests/gpu_check_test.sh
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export TMPDIR=$work # rehearse's and device's temporary folders
# A git of its own: no user or system configuration (excludes files, hooks, templates' settings).
unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE GIT_CEILING_DIRECTORIES
export HOME=$work GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
export GIT_AUTHOR_NAME=test GIT_AUTHOR_EMAIL=test@example.invalid
export GIT_COMMITTER_NAME=test GIT_COMMITTER_EMAIL=test@example.invalid
unset GPU_CHECK_LIMIT_MIB GPU_CHECK_CARRY GPU_CHECK_FLUX_MIB DIFFTRAIN_DEBIAN_MIRROR SMOKE OUT DEVICE_BUILD_DIR

checks=0
fail() {
  echo "gpu_check_test: FAIL: $*" >&2
  exit 1
}
ok() {
  checks=$((checks + 1))
  echo "ok $checks: $*"
}

r=$work/repo
gc() { bash "$r/scripts/gpu_check" "$@"; }

# The fake repository: goldens the GPU needs and does not, a staged change and an unstaged one on
# top, a staged change in a hidden golden, an unstaged one in another, untracked files (one in a
# hidden folder), an ignored file, and an info/exclude with no final newline.
make_repo() {
  rm -rf "$r"
  mkdir -p "$r"
  cd "$r"
  git init -q
  mkdir -p scripts/lib src tests/golden/sdxl/tiny_sdxl/unet tests/golden/sdxl/tiny_sdxl/vae tests/golden/sd \
    tests/golden/samplers tests/golden/diffusers/unet2d tests/golden/diffusers/unet_cond tests/golden/diffusers/other
  cp "$src/scripts/gpu_check" scripts/
  cp "$src/scripts/lib/apt_mirror.sh" scripts/lib/
  head -c 3000000 /dev/urandom >tests/golden/sdxl/big.bin
  echo '{"u": 1}' >tests/golden/sdxl/tiny_sdxl/unet/config.json
  echo weights >tests/golden/sdxl/tiny_sdxl/unet/model.safetensors
  echo vae >tests/golden/sdxl/tiny_sdxl/vae/config.json
  head -c 200000 /dev/urandom >tests/golden/sd/a.bin
  echo '{"s": 1}' >tests/golden/samplers/s.json
  head -c 1500000 /dev/urandom >tests/golden/diffusers/unet2d/x
  echo '{"c": 1}' >tests/golden/diffusers/unet_cond/config.json
  echo y >tests/golden/diffusers/other/y
  echo readme >tests/golden/diffusers/README.md
  echo '{}' >tests/golden/top.json
  echo 'int main() {}' >src/a.cpp
  printf '/build/\n' >.gitignore
  git add -A
  git commit -q -m init
  echo 'int a;' >>src/a.cpp
  git add src/a.cpp
  echo '// unstaged' >>src/a.cpp
  head -c 1000 /dev/urandom >>tests/golden/sd/a.bin
  git add tests/golden/sd/a.bin
  echo more >>tests/golden/samplers/s.json
  echo notes >notes.txt
  echo new >tests/golden/sdxl/new.bin
  mkdir -p build .git/info
  echo o >build/out.o
  printf '# mine\n*.swp' >>.git/info/exclude
}

# git's view and the work tree's contents, into files named $1.*
snapshot() {
  git ls-files -s >"$1.index"
  git ls-files -co --exclude-standard | sort >"$1.listed"
  git diff --cached --binary >"$1.cached"
  git status --porcelain --untracked-files=all >"$1.status"
  if [ -e .git/info/exclude ]; then cp .git/info/exclude "$1.exclude"; else echo '(absent)' >"$1.exclude"; fi
  find . -path ./.git -prune -o -type f -print0 | sort -z | xargs -0 sha256sum >"$1.tree"
}
same() { # $1 $2: snapshots; $3...: which parts
  local a=$1 b=$2 what
  shift 2
  for what in "$@"; do
    cmp -s "$a.$what" "$b.$what" || { diff "$a.$what" "$b.$what" | head -n 20 >&2; return 1; }
  done
}

# fails_and_unpacks WHAT PATTERN BEFORE AFTER VAR=VALUE VERB [ARGS...]: the verb, run with the
# variable set, must fail saying PATTERN and leave the repository unpacked, with git's view (the
# snapshot AFTER) as in the snapshot BEFORE.
fails_and_unpacks() {
  local what=$1 pattern=$2 before=$3 after=$4 setting=$5 rc=0 out
  shift 5
  out=$(env "$setting" bash "$r/scripts/gpu_check" "$@" 2>&1) || rc=$?
  [ "$rc" != 0 ] || fail "$what succeeded: $out"
  grep -q -- "$pattern" <<<"$out" || fail "$what did not say '$pattern': $out"
  grep -q 'not packed' <<<"$(gc status)" || fail "$what left the repository packed"
  snapshot "$after"
  same "$before" "$after" "${all[@]}" || fail "$what left git's view changed"
}
all=(index listed cached status exclude tree)
# What must travel while packed (of the paths in file $1): everything but what is under one of
# scripts/gpu_check's $hide paths and under none of its $keep paths (read from the script, so
# that editing its lists needs no edit here).
hide=() keep=()
eval "$(grep -E '^(hide|keep)=\(' "$src/scripts/gpu_check")"
if [ "${#hide[@]}" -lt 4 ] || [ "${#keep[@]}" -lt 2 ]; then fail "cannot read hide=(...) and keep=(...) from scripts/gpu_check"; fi
under() { # $1 path, $2... prefixes
  local p=$1 x
  shift
  for x in "$@"; do if [ "$p" = "$x" ] || [[ $p == "$x"/* ]]; then return 0; fi; done
  return 1
}
expected_listed() {
  local p
  while IFS= read -r p; do
    if ! under "$p" "${hide[@]}" || under "$p" "${keep[@]}"; then printf '%s\n' "$p"; fi
  done <"$1"
}
# Bytes of the regular files git lists (what the device tool copies), counted independently.
listed_bytes() {
  git ls-files -z -co --exclude-standard | sort -zu | xargs -0 stat -c %s | awk '{ s += $1 } END { print s }'
}
# The bytes column of the size table's line starting with $1 (from stdin).
bytes_of() { grep -F "  $1" | head -n 1 | sed -E 's/.* MiB +([0-9]+) bytes.*/\1/'; }

# ---------------------------------------------------------------- pack, size, unpack
make_repo
snapshot "$work/before"
[ "$(wc -l <"$work/before.status")" -ge 5 ] || fail "the fake repository's status is too small to test anything"

out=$(gc pack) || fail "pack failed: $out"
grep -q 'hid .* paths' <<<"$out" || fail "pack printed no summary: $out"
snapshot "$work/packed"
sort "$work/before.listed" >"$work/before.sorted"
expected_listed "$work/before.sorted" | sort >"$work/expected.listed"
cmp -s "$work/expected.listed" "$work/packed.listed" ||
  { diff "$work/expected.listed" "$work/packed.listed" >&2; fail "pack did not hide exactly the hidden goldens from git ls-files -co --exclude-standard"; }
grep -q '^tests/golden/diffusers/unet2d/x$' "$work/packed.listed" || fail "a kept golden is hidden"
grep -q '^tests/golden/sdxl/tiny_sdxl/unet/config.json$' "$work/packed.listed" || fail "a kept golden file in a hidden folder is hidden"
! grep -q '^tests/golden/sdxl/tiny_sdxl/unet/model.safetensors$' "$work/packed.listed" || fail "a file beside a kept one travels"
grep -q '^tests/golden/top.json$' "$work/packed.listed" || fail "a top-level golden is hidden"
grep -q '^notes.txt$' "$work/packed.listed" || fail "an untracked file outside the goldens is hidden"
! grep -q '^tests/golden/sdxl/new.bin$' "$work/packed.listed" || fail "an untracked file in a hidden folder travels"
ok "pack hides exactly tests/golden/{sdxl (but tiny_sdxl/unet/config.json),sd,samplers,diffusers/other,diffusers/README.md}, tracked or not"
same "$work/before" "$work/packed" tree || fail "pack changed the work tree"
ok "pack leaves every work-tree file as it was (sha256 of each)"
grep -q 'packed since' <<<"$(gc status)" || fail "status does not say packed"
ok "status says packed"

rc=0
out=$(gc pack 2>&1) || rc=$?
[ "$rc" != 0 ] || fail "a second pack succeeded"
grep -q 'already packed.*run scripts/gpu_check unpack first' <<<"$out" || fail "a second pack said: $out"
snapshot "$work/packed2"
same "$work/packed" "$work/packed2" "${all[@]}" || fail "the refused second pack changed something"
ok "pack twice is refused ('$out') and changes nothing"

size_out=$(gc size) || fail "size failed while packed under the limit: $size_out"
[ "$(echo "$size_out" | bytes_of 'travelling now (packed)')" = "$(listed_bytes)" ] ||
  fail "size's 'travelling now' is not the bytes of the listed files ($(listed_bytes)): $size_out"
ok "size counts the bytes of what git lists ($(listed_bytes) bytes packed)"

out=$(gc unpack) || fail "unpack failed: $out"
snapshot "$work/after"
same "$work/before" "$work/after" "${all[@]}" || fail "unpack did not restore git's view exactly"
grep -q 'not packed' <<<"$(gc status)" || fail "status does not say not packed"
ok "unpack restores ls-files -s, ls-files -co, diff --cached, status --porcelain, info/exclude (no final newline) byte for byte"

out=$(gc unpack) || fail "a second unpack failed: $out"
grep -q 'nothing to do' <<<"$out" || fail "a second unpack said: $out"
snapshot "$work/after2"
same "$work/before" "$work/after2" "${all[@]}" || fail "a second unpack changed something"
ok "a second unpack is a no-op ('$out')"

# ---------------------------------------------------------------- the size limit
size_out=$(gc size) || fail "size (not packed) failed: $size_out"
[ "$(echo "$size_out" | bytes_of 'travelling now (not packed)')" = "$(listed_bytes)" ] || fail "size (not packed) is wrong: $size_out"
after_pack=$(echo "$size_out" | bytes_of 'after scripts/gpu_check pack')
git ls-files -co --exclude-standard | sort >"$work/listed"
[ "$after_pack" = "$(expected_listed "$work/listed" | tr '\n' '\0' | xargs -0 stat -c %s | awk '{ s += $1 } END { print s }')" ] ||
  fail "size's 'after pack' ($after_pack) is wrong: $size_out"
worst=$(echo "$size_out" | bytes_of 'packed, if tests/golden/flux')
[ "$worst" = $((after_pack + 20 * 1048576)) ] || fail "size's FLUX worst case ($worst) is not after-pack + 20 MiB"
ok "size (not packed) reports what pack would leave ($after_pack bytes) and the FLUX worst case (+20 MiB)"
rc=0
GPU_CHECK_LIMIT_MIB=1 gc size >/dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "size above GPU_CHECK_LIMIT_MIB=1 exited $rc"
GPU_CHECK_LIMIT_MIB=1000 gc size >/dev/null || fail "size under GPU_CHECK_LIMIT_MIB=1000 failed"
ok "size exits 1 above GPU_CHECK_LIMIT_MIB and 0 below"
fails_and_unpacks "pack above the limit (1 MiB; 1.5 MB travel packed)" 'OVER the limit' \
  "$work/before" "$work/after3" GPU_CHECK_LIMIT_MIB=1 pack
ok "pack above GPU_CHECK_LIMIT_MIB fails and unpacks itself exactly"
grep -Eq 'carry build .* 2 bytes' <<<"$(GPU_CHECK_CARRY=build GPU_CHECK_LIMIT_MIB=1000 gc size)" || fail "size does not count a carried path"
ok "size counts the carried paths (GPU_CHECK_CARRY)"

# ---------------------------------------------------------------- no .git/info at all
rm -rf .git/info
snapshot "$work/noinfo"
gc pack >/dev/null || fail "pack without .git/info failed"
[ -s .git/info/exclude ] || fail "pack wrote no .git/info/exclude"
gc unpack >/dev/null
[ ! -e .git/info ] || fail "unpack left a .git/info that did not exist before pack"
snapshot "$work/noinfo2"
same "$work/noinfo" "$work/noinfo2" "${all[@]}" || fail "pack/unpack without .git/info did not restore exactly"
ok "without .git/info, unpack removes the .git/info pack made"

# ---------------------------------------------------------------- git add while packed
gc pack >/dev/null
echo more-notes >>notes.txt
git add notes.txt
out=$(gc unpack 2>&1) || fail "unpack after a git add failed: $out"
git ls-files -s | grep -v $'\tnotes.txt$' >"$work/add.index"
grep -v $'\tnotes.txt$' "$work/noinfo.index" >"$work/add.expected"
cmp -s "$work/add.expected" "$work/add.index" || fail "unpack after a git add did not restore the hidden entries"
git ls-files --error-unmatch notes.txt >/dev/null || fail "unpack dropped what was staged while packed"
snapshot "$work/add"
same "$work/noinfo" "$work/add" listed exclude || fail "unpack after a git add: listing or exclude differ"
ok "a git add made while packed is kept; the hidden entries come back as they were"
git rm -q --cached notes.txt

# ---------------------------------------------------------------- commit while packed
snapshot "$work/c0"
git ls-files -s -- tests/golden >"$work/c0.golden"
gc pack >/dev/null
git commit -q -m 'made while packed'
grep -q 'tests/golden/sdxl/big.bin' <<<"$(git show --stat HEAD)" || fail "the commit made while packed did not record the deletion (test setup)"
out=$(gc unpack 2>&1) || fail "unpack after a commit failed: $out"
grep -q 'staged again' <<<"$out" || fail "unpack after a commit did not say the hidden files are staged again: $out"
git ls-files -s -- tests/golden >"$work/c1.golden"
cmp -s "$work/c0.golden" "$work/c1.golden" || fail "unpack after a commit did not stage the hidden files as they were"
grep -q '^A' <<<"$(git diff --cached --name-status HEAD -- tests/golden/sdxl/big.bin)" || fail "the hidden files are not staged against the new HEAD"
snapshot "$work/c1"
same "$work/c0" "$work/c1" listed exclude tree || fail "unpack after a commit: listing, exclude or work tree differ"
git commit -q -m 'the goldens back'
# What is committed now is what was staged before pack (the staged change to sd/a.bin included).
[ "$(git ls-tree -r HEAD -- tests/golden | awk '{ print $1, $3, $4 }')" = "$(awk '{ print $1, $2, $4 }' "$work/c0.golden")" ] ||
  fail "the goldens committed after unpack differ from what was staged before pack"
ok "a commit made while packed: unpack stages the hidden files again, exactly; nothing lost"

# ---------------------------------------------------------------- device (SMOKE=1)
out=$(SMOKE=1 OUT=$work/out1 gc device env 2>&1) || fail "device env (SMOKE) failed: $out"
[ -s "$work/out1/01-env.log" ] || fail "device env wrote no 01-env.log"
grep -q '^| env | ok | [0-9]* | 01-env.log |$' "$work/out1/summary.txt" || fail "summary.txt: $(cat "$work/out1/summary.txt")"
grep -q '== stage env took [0-9]* s' <<<"$out" || fail "device env printed no time: $out"
ok "device env (SMOKE=1) writes 01-env.log and summary.txt, timed"
rc=0
out=$(SMOKE=1 OUT=$work/out2 DEVICE_BUILD_DIR=$work/nobuild gc device env difftrain-env gpu-tests 2>&1) || rc=$?
[ "$rc" != 0 ] || fail "device with a failing stage succeeded: $out"
grep -q 'gpu_check: stage difftrain-env failed (log: .*04-difftrain-env.log)' <<<"$out" || fail "device's failure message: $out"
grep -q '^| difftrain-env | FAILED' "$work/out2/summary.txt" || fail "summary.txt lacks the failure: $(cat "$work/out2/summary.txt")"
[ ! -e "$work/out2/05-gpu-tests.log" ] || fail "device ran a stage after a failed one"
ok "device stops at a failing stage, with its log's end, and the summary says FAILED"
rc=0
gc device nosuchstage >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "device with an unknown stage exited $rc"
ok "device refuses an unknown stage"

# ---------------------------------------------------------------- rehearse
make_repo
snapshot "$work/r0"
out=$(gc rehearse env 2>&1) || fail "rehearse env failed: $out"
grep -q 'no hidden path travelled' <<<"$out" || fail "rehearse did not check the copy: $out"
grep -q 'rehearse: passed' <<<"$out" || fail "rehearse did not pass: $out"
snapshot "$work/r1"
same "$work/r0" "$work/r1" "${all[@]}" || fail "rehearse left git's view changed"
ok "rehearse (env): pack, copy checked, device run, unpack, git as before"
fails_and_unpacks "rehearse with a failing device stage" 'unpack' "$work/r0" "$work/r2" \
  DEVICE_BUILD_DIR="$work/nobuild" rehearse difftrain-env
ok "a failed rehearse still unpacks and leaves git as it was"

# ---------------------------------------------------------------- debian_mirror
mirror() { # APT_SOURCES_ROOT=$1; prints debian_mirror's output (stdout and stderr) and its status
  local rc=0 o
  o=$(APT_SOURCES_ROOT=$1 bash -c 'set -euo pipefail; source "$1"; debian_mirror test' _ "$src/scripts/lib/apt_mirror.sh" 2>&1) || rc=$?
  printf '%s rc=%s' "$o" "$rc"
}
a=$work/apt
mkdir -p "$a/this/sources.list.d" "$a/deb822/sources.list.d" "$a/oneline" "$a/disabled/sources.list.d" \
  "$a/ubuntu/sources.list.d" "$a/order/sources.list.d"
cat >"$a/this/sources.list.d/debian.sources" <<'EOF'
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
# http://snapshot.debian.org/archive/debian-security/20250520T000000Z
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
[ "$(mirror "$a/this")" = "http://deb.debian.org/debian rc=0" ] || fail "debian_mirror on a stock Debian 12 sources file: $(mirror "$a/this")"
cat >"$a/deb822/sources.list.d/debian.sources" <<'EOF'
# security first
Types: deb
URIs: http://security.invalid/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.invalid/debian
Suites: trixie
Components: main

Types: deb
URIs: http://updates.invalid/debian
Suites: trixie-updates trixie-backports
Components: main

Types: deb
URIs: http://contrib.invalid/debian
Suites: trixie
Components: contrib non-free

types: deb deb-src
uris: http://archive.invalid/debian/
  http://second.invalid/debian
suites: trixie
components: main contrib
EOF
[ "$(mirror "$a/deb822")" = "http://archive.invalid/debian/ rc=0" ] || fail "debian_mirror, deb822 with security first: $(mirror "$a/deb822")"
cat >"$a/oneline/sources.list" <<'EOF'
# deb http://commented.invalid/debian bookworm main
deb-src http://src.invalid/debian bookworm main
deb http://security.invalid/debian-security bookworm-security main
deb http://updates.invalid/debian bookworm-updates main
deb [ arch=amd64 ] http://contrib.invalid/debian bookworm contrib
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg arch=amd64] http://one.invalid/debian stable main contrib # the archive
EOF
[ "$(mirror "$a/oneline")" = "http://one.invalid/debian rc=0" ] || fail "debian_mirror, one-line with [options]: $(mirror "$a/oneline")"
cat >"$a/disabled/sources.list.d/debian.sources" <<'EOF'
Types: deb
URIs: http://off.invalid/debian
Suites: trixie
Components: main
Enabled: no

Types: deb
URIs: http://on.invalid/debian
Suites: sid
Components: main
EOF
[ "$(mirror "$a/disabled")" = "http://on.invalid/debian rc=0" ] || fail "debian_mirror, a disabled stanza: $(mirror "$a/disabled")"
echo 'deb http://archive.ubuntu.invalid/ubuntu jammy main restricted' >"$a/ubuntu/sources.list"
cat >"$a/ubuntu/sources.list.d/ubuntu.sources" <<'EOF'
Types: deb
URIs: http://archive.ubuntu.invalid/ubuntu
Suites: noble noble-updates noble-backports
Components: main universe
EOF
expected="test: no Debian archive among this machine's apt sources ($a/ubuntu/sources.list, $a/ubuntu/sources.list.d): set DIFFTRAIN_DEBIAN_MIRROR=<URI of a Debian mirror> rc=1"
[ "$(mirror "$a/ubuntu")" = "$expected" ] || fail "debian_mirror, Ubuntu only: $(mirror "$a/ubuntu")"
[ "$(mirror "$a/nonexistent")" = "${expected//ubuntu/nonexistent}" ] || fail "debian_mirror, no sources at all: $(mirror "$a/nonexistent")"
[ "$(DIFFTRAIN_DEBIAN_MIRROR=http://override.invalid/debian mirror "$a/ubuntu")" = "http://override.invalid/debian rc=0" ] ||
  fail "DIFFTRAIN_DEBIAN_MIRROR does not override"
cp "$a/ubuntu/sources.list" "$a/order/sources.list"
echo 'deb http://b.invalid/debian bookworm main' >"$a/order/sources.list.d/b.list"
printf 'Types: deb\nURIs: http://a.invalid/debian\nSuites: testing\nComponents: main\n' >"$a/order/sources.list.d/a.sources"
[ "$(mirror "$a/order")" = "http://a.invalid/debian rc=0" ] || fail "debian_mirror, sources.list.d in name order: $(mirror "$a/order")"
echo 'deb http://first.invalid/debian oldstable main' >"$a/order/sources.list"
[ "$(mirror "$a/order")" = "http://first.invalid/debian rc=0" ] || fail "debian_mirror, sources.list first: $(mirror "$a/order")"
ok "debian_mirror: deb822 (security first, deb-src, -updates, no main, lower-case keys, continuation), one-line ([options], comments), Enabled: no, Ubuntu only (the error), the override, apt's file order"
if grep -n 'deb\.debian\.org' "$src/scripts/gpu_build" "$src/scripts/debian13"; then fail "a script names Debian's host"; fi
ok "scripts/gpu_build and scripts/debian13 name no host"

echo "gpu_check_test: all $checks checks passed"
