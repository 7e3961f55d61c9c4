"""Performance benchmarks: each script prints a side-by-side table against a baseline measured in the same run."""
