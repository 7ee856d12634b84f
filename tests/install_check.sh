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
# A model family built outside the tree (examples/custom_family): registered by its own program,
# which runs difftrain's command line; every command works on its folders.
toy=$work/build/custom_family/custom_family
[ -x "$toy" ] || fail "examples/custom_family was not built"
t=$work/toy
"$toy" toy-init "$t/model" 1 >/dev/null || fail "custom_family toy-init failed"
final_loss() { sed -nE 's/.*final loss ([0-9.]+).*/\1/p' "$1" | tail -1; }
"$toy" launch -n 2 --cpu "$toy" train --pretrained_model_name_or_path "$t/model" --lora \
  --max_train_steps 60 --toy_samples 16 --output_dir "$t/lora" >"$t/lora.log" 2>&1 ||
  { cat "$t/lora.log"; fail "toy-dit LoRA training on 2 ranks failed"; }
"$toy" launch -n 2 --cpu "$toy" train --pretrained_model_name_or_path "$t/model" \
  --max_train_steps 100 --validation_steps 100 --validation_inference_steps 8 \
  --output_dir "$t/full" >"$t/full.log" 2>&1 || { cat "$t/full.log"; fail "toy-dit full training on 2 ranks failed"; }
lora_loss=$(final_loss "$t/lora.log") full_loss=$(final_loss "$t/full.log")
# A fresh model's flow-matching loss on these stripes starts near 1.6 (E|noise - x0|^2).
awk -v a="$lora_loss" -v b="$full_loss" 'BEGIN { exit !(a < 1.3 && b < 1.0) }' ||
  fail "toy-dit did not learn: final loss LoRA $lora_loss (want < 1.3), full $full_loss (want < 1.0)"

for f in lora/pytorch_lora_weights.safetensors lora/toy_lora.safetensors lora/README.md \
         full/model_index.json full/model.safetensors full/samples/step-000100.png; do
  [ -e "$t/$f" ] || fail "toy-dit training wrote no $f"
done
"$toy" sample --model "$t/full" --prompt horizontal --prompt vertical --num_inference_steps 8 \
  --output "$t/full.png" --save_tensors "$t/full.safetensors" >"$t/sample.log" 2>&1 ||
  { cat "$t/sample.log"; fail "sample of the toy-dit export failed"; }
# Its own sample option: --toy_shift 1 is the default exactly, 3 draws otherwise; a UNet folder
# refuses it naming toy-dit.
for shift in 1 3; do
  "$toy" sample --model "$t/full" --prompt horizontal --prompt vertical --num_inference_steps 8 \
    --toy_shift $shift --output "$t/shift$shift.png" --save_tensors "$t/shift$shift.safetensors" \
    >>"$t/sample.log" 2>&1 || { cat "$t/sample.log"; fail "sample with --toy_shift $shift failed"; }
done
cmp -s "$t/full.safetensors" "$t/shift1.safetensors" || fail "--toy_shift 1 changed the samples"
if cmp -s "$t/full.safetensors" "$t/shift3.safetensors"; then fail "--toy_shift 3 changed nothing"; fi
if "$toy" sample --model "$src/tests/golden/diffusers/unet2d_uncond" --toy_shift 2 \
  --output "$t/unet.png" >"$t/refused_sample.log" 2>&1; then
  fail "a UNet folder took --toy_shift"
fi
grep -q -- '--toy_shift is an option of the toy-dit family' "$t/refused_sample.log" ||
  { cat "$t/refused_sample.log"; fail "--toy_shift was not refused naming its family"; }
# Its own LoRA layout read by io, converted to kohya names (resolved by the family) and back, samples
# exactly as the file it started from.
"$toy" lora convert --input "$t/lora/toy_lora.safetensors" --output "$t/kohya.safetensors" --to kohya \
  --model "$t/model" >"$t/convert.log" 2>&1 || { cat "$t/convert.log"; fail "lora convert of toy-dit's layout failed"; }
"$toy" lora convert --input "$t/kohya.safetensors" --output "$t/back.safetensors" --to diffusers \
  --model "$t/model" >>"$t/convert.log" 2>&1 || { cat "$t/convert.log"; fail "lora convert back from kohya failed"; }
grep -q "16 denoiser targets" "$t/convert.log" || { cat "$t/convert.log"; fail "lora convert did not keep 16 denoiser targets"; }
for lora in lora/toy_lora.safetensors back.safetensors; do
  "$toy" sample --model "$t/model" --lora "$t/$lora" --prompt horizontal --num_inference_steps 8 \
    --output "$t/${lora//\//_}.png" --save_tensors "$t/${lora//\//_}.safetensors" >>"$t/sample.log" 2>&1 ||
    { cat "$t/sample.log"; fail "sample with the toy-dit LoRA $lora failed"; }
done
cmp -s "$t/lora_toy_lora.safetensors.safetensors" "$t/back.safetensors.safetensors" ||
  fail "the LoRA converted to kohya and back samples differently from toy-dit's own file"
"$toy" estimate-memory --model "$t/model" --lora --num_processes 2 >"$t/memory.log" 2>&1 &&
  grep -q FULL_SHARD "$t/memory.log" || { cat "$t/memory.log"; fail "estimate-memory of a toy-dit folder failed"; }
# Its option belongs to it: another family's run refuses it, naming toy-dit.
if "$toy" train --toy_samples 4 >"$t/refused.log" 2>&1; then fail "a UNet run took --toy_samples"; fi
grep -q '"toy_samples" is an option of the toy-dit family' "$t/refused.log" ||
  { cat "$t/refused.log"; fail "--toy_samples was not refused naming its family"; }
echo "install_check: the installed package builds examples/ out of tree; custom_loop's final loss on 2 ranks $loss (< 0.5); the toy-dit family (examples/custom_family) trained on 2 ranks (final loss LoRA $lora_loss, full $full_loss), sampled, converted its own LoRA layout exactly and estimated its memory"
