"""Fuzz targets: one per parser that takes outside input.

Each target is run two ways: briefly by hypothesis inside the trial suite
(tests/fuzzing/test_*.py), and for a long run by ``benchmarks/fuzz.py``.
"""
