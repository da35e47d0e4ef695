"""``python -m benchmarks.replay_diff BEFORE.json AFTER.json``: kept under the name other tools and
earlier docs call; the code is :mod:`benchmarks.replay.diff`."""

import sys

from benchmarks.replay.diff import differences, main  # noqa: F401  (this module's names before the move)

if __name__ == "__main__":
    sys.exit(main())
