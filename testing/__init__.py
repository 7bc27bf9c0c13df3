"""Test helpers shared by every test directory; `testing.fixtures` holds the pytest fixtures, registered once by
the repo-root conftest.py."""
