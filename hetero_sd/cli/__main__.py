"""`python -m hetero_sd.cli`: the `hetero-sd` command."""

import sys

from hetero_sd.cli import main

sys.exit(main())
