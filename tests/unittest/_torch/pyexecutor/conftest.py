"""Fixtures shared by the executor tests live in tests/conftest.py (``one_torch_thread``)."""
