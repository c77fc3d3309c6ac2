"""``python -m mla_prefill_ext``: the command line."""

import sys

from mla_prefill_ext.cli import main

sys.exit(main())
