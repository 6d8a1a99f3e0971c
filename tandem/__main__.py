"""``python -m tandem <command> [args ...]``: the same as the ``tandem`` console command."""

import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main())
