"""``python -m minippo`` is the ``minippo`` command."""

import sys

from minippo._cli.main import main

sys.exit(main())
