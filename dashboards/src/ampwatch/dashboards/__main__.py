"""Allow ``python -m ampwatch.dashboards generate``."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
