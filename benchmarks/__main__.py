"""``python -m benchmarks NAME [flags]``: run one benchmark from a source checkout."""

import sys

from benchmarks import main

if __name__ == "__main__":
    main(sys.argv[1:])
