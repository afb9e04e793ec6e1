"""The ``vmready`` command."""
