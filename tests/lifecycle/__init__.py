"""Tests of vmready.lifecycle."""
