"""Tests of protocol/."""
