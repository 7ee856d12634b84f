#!/usr/bin/env bash
# scripts/link_order must not change what any symbol binds to: the dynamic loader's bindings of
# startup_probe (libraries named first) and startup_probe_natural (the linker's order), every
# symbol resolved at load (LD_BIND_NOW), must be the same reference for reference, up to which
# copy of a weak (inline) definition carried by several libraries is taken. Also checks that the
# ordered probe really names scripts/link_order's libraries first when the build applied it.
#   bash tests/link_order_check.sh ORDERED_PROBE NATURAL_PROBE APPLIED(ON|OFF)
set -euo pipefail
ordered="$1" natural="$2" rsp="${3:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
bindings() {  # "<from library> <symbol> <to library>" for every binding made by a library
  LD_BIND_NOW=1 LD_DEBUG=bindings LD_DEBUG_OUTPUT="$work/$2" "$1" >/dev/null
  cat "$work/$2".* |
    sed -n "s/.*binding file \([^ ]*\) \[[0-9]*\] to \([^ ]*\) \[[0-9]*\]: normal symbol \`\([^']*\)'.*/\1 \3 \2/p" |
    awk -v exe="$1" '$1 != exe { if ($3 == exe) $3 = "EXE"; print }' | sort -u
}
bindings "$ordered" ordered >"$work/a"
bindings "$natural" natural >"$work/b"
count="$(wc -l <"$work/b")"
if ((count < 1000)); then
  echo "link_order_check: only $count bindings read from LD_DEBUG (expected LibTorch's thousands)" >&2
  exit 1
fi
# A reference may go to another copy only when both copies are weak: inline functions, template
# instantiations and vague-linkage objects that several C++ libraries carry identically, and of
# which every reference in the process still takes one and the same copy.
join -j1 <(awk '{print $1 "|" $2, $3}' "$work/b" | sort) <(awk '{print $1 "|" $2, $3}' "$work/a" | sort) |
  awk '$2 != $3 {split($1, k, "|"); print k[2], $2, $3}' >"$work/moved"
if [[ -s "$work/moved" ]]; then
  # A reference that moves to or from the probe itself is fine: the executable's definitions
  # (its weak template copies, its copy-relocated data) interpose every library's, so that
  # process still has one copy. The libraries' own moves are checked.
  awk '$2 != "EXE" && $3 != "EXE"' "$work/moved" >"$work/moved2" && mv "$work/moved2" "$work/moved"
  awk '{print $2; print $3}' "$work/moved" | sort -u | while read -r lib; do
    nm -D --defined-only "$lib" 2>/dev/null | awk -v lib="$lib" 'NF >= 3 {sub(/@.*/, "", $3); print lib, $3, $2}'
  done >"$work/types"
  bad="$(awk 'NR == FNR {type[$1 " " $2] = $3; next}
              {a = type[$2 " " $1]; b = type[$3 " " $1];
               if (a !~ /^[WVu]$/ || b !~ /^[WVu]$/) print $1, "natural:", $2, "(" a ")", "reordered:", $3, "(" b ")"}' \
    "$work/types" "$work/moved")"
  if [[ -n "$bad" ]]; then
    echo "link_order_check: symbols bind to a different definition with the reordered libraries:" >&2
    echo "$bad" | head -20 >&2
    exit 1
  fi
fi
if [[ "$(cut -d' ' -f1,2 "$work/a")" != "$(cut -d' ' -f1,2 "$work/b")" ]]; then
  echo "link_order_check: the two orders resolve different sets of references" >&2
  exit 1
fi
moved="$(wc -l <"$work/moved")"
needed() { readelf -d "$1" | awk '/NEEDED/ {gsub(/[\[\]]/, "", $5); print $5}'; }
applied=no
if [[ -n "$rsp" ]] && grep -q '^/' "$rsp"; then
  applied="$(grep -c '^/' "$rsp")"
  want="$(grep '^/' "$rsp" | while read -r lib; do
    readelf -dW "$lib" | awk '/SONAME/ {gsub(/[\[\]]/, "", $5); print $5}'
  done)"
  if [[ "$(needed "$ordered" | head -n "$applied")" != "$want" ]]; then
    echo "link_order_check: $ordered does not name $rsp's $applied libraries first" >&2
    exit 1
  fi
fi
echo "link_order_check: $count bindings; $moved go to another copy of a weak (inline) definition, none to another definition (libraries named first: $applied)"
