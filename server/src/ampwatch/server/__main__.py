"""Command-line entry point of the collector."""

import sys


def main() -> int:
    print("ampwatch-server: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
