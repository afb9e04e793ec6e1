"""vmready's trial test suite."""
