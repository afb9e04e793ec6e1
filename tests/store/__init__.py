"""Tests of vmready.store."""
