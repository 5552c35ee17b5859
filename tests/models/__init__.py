"""Tests of models/."""
