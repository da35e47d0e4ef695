"""Command-line tools that run from the checkout (python -m tools.NAME)."""
