"""``python -m benchmarks.replay``: the replay CLI (:mod:`benchmarks.replay.cli`)."""

import sys

from benchmarks.replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
