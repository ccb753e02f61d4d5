"""`python -m hisparse ...`: the same command line as the `hisparse` console script."""

import sys

from hisparse.cli.main import main

sys.exit(main())
