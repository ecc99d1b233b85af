"""``python -m cce_autotune.cli``: the ``cce-tune`` command."""

import sys

from . import main

sys.exit(main())
