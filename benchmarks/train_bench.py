"""``python -m benchmarks.train_bench``: kept for existing commands; the benchmark is ``ccft.bench.train``
(``ccft bench train``)."""

import sys

from ccft.bench.train import main

if __name__ == "__main__":
    sys.exit(main())
