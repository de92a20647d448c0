"""``python -m nano_engine``: the nano-engine command."""

import sys

from nano_engine.cli import main

sys.exit(main())
