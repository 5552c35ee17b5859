"""Tests of gateway/."""
