"""The attnkit benchmark suite as a script: ``python benchmarks/suite.py [--quick] ...``.

Same code as ``attnkit bench`` (the harness is ``attnkit._bench``; one implementation).
"""

import sys

from attnkit._bench import main

if __name__ == "__main__":
    sys.exit(main())
