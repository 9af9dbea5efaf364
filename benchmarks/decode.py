"""``python -m benchmarks.decode``: kept for existing commands; the benchmark is ``ccft.bench.decode``
(``ccft bench decode``)."""

import sys

from ccft.bench.decode import main

if __name__ == "__main__":
    sys.exit(main())
