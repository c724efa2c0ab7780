"""One PNG per seed from the JSON that benchmarks/seed_tables.sh writes (nothing is re-measured); what each PNG
shows: draftwise/bench/seed_plots.py.

    python benchmarks/seed_plots.py out/seed-tables-pair            # every seed whose JSON is there
    python benchmarks/seed_plots.py out/seed-tables-pair --only mtad
"""

import sys

from draftwise.bench.seed_plots import main

if __name__ == "__main__":
    sys.exit(main())
