"""Tests of cluster/."""
