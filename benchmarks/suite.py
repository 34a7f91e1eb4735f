"""The full attnkit benchmark suite from a checkout: ``python benchmarks/suite.py [options]``.

The same harness as ``attnkit bench`` (installed as :mod:`attnkit.bench`), with ``--full``
implied: every case at L = 4096/16384, fp32 and bf16, every peer, memory at 64k and 128k
(tens of minutes on 2 cores). Any ``attnkit bench`` option may follow; it writes only
where ``--json``/``--markdown`` say. ``make benchmarks-md`` runs this and then
``benchmarks/update_md.py`` to refresh the generated section of BENCHMARKS.md.
"""

import sys

from attnkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--full", *sys.argv[1:]]))
