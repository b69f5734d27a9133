"""``python -m qlint``: the same as the ``qlint`` command."""

import sys

from qlint.cli.main import main

sys.exit(main())
