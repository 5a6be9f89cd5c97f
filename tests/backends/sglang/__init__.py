"""Tests of the sglang backend and its emulator."""
