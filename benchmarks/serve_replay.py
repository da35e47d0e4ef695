"""``python -m benchmarks.serve_replay --url URL ...``: kept under the name of the server's contract
(docs/design.md §6) and earlier docs; the code is :mod:`benchmarks.serving.replay`."""

import sys

from benchmarks.serving.replay import main

if __name__ == "__main__":
    sys.exit(main())
