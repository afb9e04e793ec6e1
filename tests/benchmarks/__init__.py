"""The benchmarks' own pieces (the fault proxy, the history checker) and their short runs."""
