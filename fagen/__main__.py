"""`python -m fagen ...` is the `fagen` command."""

import sys

from .cli import main

sys.exit(main())
