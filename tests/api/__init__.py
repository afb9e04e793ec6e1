"""Tests of vmready.api."""
