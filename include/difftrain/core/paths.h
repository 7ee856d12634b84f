#pragma once

#include <string>

namespace difftrain {

/// difftrain's per-user cache folder: $XDG_CACHE_HOME/difftrain, else $HOME/.cache/difftrain,
/// else <temp>/difftrain-cache-<uid>. Not created here.
std::string user_cache_dir();

}  // namespace difftrain
