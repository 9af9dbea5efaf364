"""``python -m benchmarks.serve_bench``: kept for existing commands; the benchmark is ``ccft.bench.serve``
(``ccft bench serve``)."""

import sys

from ccft.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
