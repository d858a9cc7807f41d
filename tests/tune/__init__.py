"""Tests of tpu_inductor/tune/: profile and tune."""
