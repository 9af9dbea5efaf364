"""``python -m ccft``: the ``ccft`` command."""

import sys

from ccft.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
