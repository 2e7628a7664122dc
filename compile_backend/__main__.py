"""`python -m compile_backend demo|inspect ...`: the `mrv2` command."""

import sys

from compile_backend.demo.cli import main

sys.exit(main())
