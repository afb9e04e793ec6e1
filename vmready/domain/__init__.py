"""The domain: states, the instance model and its errors, limits and default paths. No I/O."""
