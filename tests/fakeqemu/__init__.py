"""Tests of fakeqemu (its own tests, which may test its inside)."""
