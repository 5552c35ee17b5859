"""Tests of the project's structure: the import graph, the test lanes."""
