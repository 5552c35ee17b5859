"""Tests of deploy/."""
