#pragma once

#include <iosfwd>

namespace difftrain::launch {

/// `difftrain test` (Accelerate: `accelerate test`): joins the process group of this process and
/// checks, with exactly known values, all_reduce (sum, mean, max, min), broadcast of a model's
/// parameters, all_gather, reduce_scatter, barrier, and a gradient all-reduce against a
/// single-process recomputation of the same maths. Prints one `[PASS]`/`[FAIL]` line per check on
/// `out` (main rank only; every rank prints its failures) and returns the number of failed checks.
int run_self_test(std::ostream& out);

}  // namespace difftrain::launch
