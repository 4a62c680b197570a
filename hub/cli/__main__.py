"""`python -m hub.cli`: the same as `echo-hub`."""

import sys

from hub.cli.main import main

sys.exit(main())
