#pragma once
// Private to src/train: the option names of kohya sd-scripts and SimpleTuner that difftrain
// refuses naming its own equivalent, and the spellings it reads as its own options
// (train_config.cpp's option lookup uses both).

#include <map>
#include <string>

namespace difftrain::train {

/// kohya / SimpleTuner name -> difftrain's option (and how to use it), or, after a leading '!',
/// what to do instead where difftrain has none.
const std::map<std::string, std::string>& foreign_options();

/// Other tools' spellings of difftrain's own options (Diffusers' `repeats` -> `dataset_repeats`).
const std::map<std::string, std::string>& option_aliases();

}  // namespace difftrain::train
