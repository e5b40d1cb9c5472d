"""``python -m maxsim ...``: the same as the ``maxsim`` console script."""

import sys

from .cli import main

sys.exit(main())
