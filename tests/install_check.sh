#!/usr/bin/env bash
# difftrain used as another project uses it (ctest dist.installed_package): `cmake --install` the
# build into a prefix, configure examples/ as a separate project against it with
# find_package(difftrain), build its programs, and run them on 2 ranks under the installed
# `difftrain launch`: the custom training loop must learn its task (final loss < 0.5, from ln 3 =
# 1.10) and the all-reduce must print the mean over both ranks.
#   tests/install_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
work=$build/install_check
fail() { echo "install_check: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log" || fail "cmake --install failed ($work/install.log)"
for f in include/difftrain/accel/accelerator.h include/difftrain/version.h \
         lib/cmake/difftrain/difftrainConfig.cmake bin/difftrain; do
  [ -e "$work/prefix/$f" ] || fail "the installed package has no $f"
done
ls "$work/prefix/lib/"libdifftrain.* >/dev/null 2>&1 || fail "the installed package has no libdifftrain"
# The package must not point back into this source tree or build folder.
if grep -rl -e "$src/" -e "$build" "$work/prefix/lib/cmake"; then
  fail "the installed CMake files name the source tree or the build folder (above)"
fi
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="/usr/bin/env;CCACHE_BASEDIR=$src;ccache")
fi
cmake -S "$src/examples" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  "${launcher[@]}" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; fail "find_package(difftrain) failed"; }
cmake --build "$work/build" -j "${JOBS:-2}" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; fail "building examples/ against the package failed"; }
export OMP_NUM_THREADS=1
"$work/prefix/bin/difftrain" launch -n 2 --cpu "$work/build/custom_loop" >"$work/custom_loop.log" 2>&1 ||
  { cat "$work/custom_loop.log"; fail "custom_loop on 2 ranks failed"; }
cat "$work/custom_loop.log"
loss=$(sed -nE 's/.*final loss ([0-9.]+).*/\1/p' "$work/custom_loop.log" | tail -1)
[ -n "$loss" ] || fail "custom_loop printed no final loss"
awk -v l="$loss" 'BEGIN { exit !(l < 0.5) }' || fail "custom_loop's final loss $loss is not below 0.5"
"$work/prefix/bin/difftrain" launch -n 2 --cpu "$work/build/all_reduce" >"$work/all_reduce.log" 2>&1 ||
  { cat "$work/all_reduce.log"; fail "all_reduce on 2 ranks failed"; }
grep -q "2 rank(s): mean over ranks = \[0.5, 1.5, 2.5, 3.5\]" "$work/all_reduce.log" ||
  { cat "$work/all_reduce.log"; fail "all_reduce did not print the mean over 2 ranks"; }
echo "install_check: the installed package builds examples/ out of tree; custom_loop's final loss on 2 ranks $loss (< 0.5)"
