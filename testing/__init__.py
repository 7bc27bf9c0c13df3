"""Test helpers shared by every test directory; the repo-root conftest.py exposes them as fixtures."""
