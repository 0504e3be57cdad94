"""``python -m serval ...`` is ``serval ...`` (for Ray Jobs entrypoints and venvs without the script)."""

import sys

from serval.cli import main

sys.exit(main())
