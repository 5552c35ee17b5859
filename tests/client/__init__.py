"""Tests of client/."""
