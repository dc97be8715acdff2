"""Helpers shared by the test suite (import as ``tests.helpers``)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
