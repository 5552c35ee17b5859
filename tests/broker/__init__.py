"""Tests of broker/."""
