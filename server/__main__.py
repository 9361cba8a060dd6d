"""`python -m server serve ...` is the same as `llamastream serve ...`."""

import sys

from server.cli import main

sys.exit(main())
