"""Run the benchmarks: ``python -m bench [--quick]``."""

import sys

from bench import ingest

if __name__ == "__main__":
    sys.exit(ingest.main(sys.argv[1:]))
