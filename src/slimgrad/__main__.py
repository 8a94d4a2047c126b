"""``python -m slimgrad``: the ``slimgrad`` command (``[project.scripts] slimgrad =
"slimgrad.cli:main"``), for environments where the console script is not on PATH."""

import sys

from slimgrad.cli import main

if __name__ == "__main__":
    sys.exit(main())
