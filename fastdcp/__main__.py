"""``python -m fastdcp``: see :mod:`fastdcp.cli`."""

import sys

from .cli import main

sys.exit(main())
