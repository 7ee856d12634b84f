#pragma once

#include "difftrain/distributed/process_group.h"

#include <iosfwd>

namespace difftrain::launch {

/// `difftrain test` (Accelerate: `accelerate test`): joins the process group of this process and
/// checks, with exactly known values, all_reduce (sum, mean, max, min), broadcast of a model's
/// parameters, all_gather, reduce_scatter, barrier, and a gradient all-reduce against a
/// single-process recomputation of the same maths. Prints one `[PASS]`/`[FAIL]` line per check on
/// `out` (main rank only; every rank prints its failures) and returns the number of failed checks.
int run_self_check(std::ostream& out);

/// The same checks on an existing group (ranks may be threads of one process: no global RNG is
/// used). Returns the number of failed checks.
int run_checks(distributed::ProcessGroup& group, std::ostream& out);

}  // namespace difftrain::launch
