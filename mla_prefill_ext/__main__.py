import sys

from mla_prefill_ext.cli import main

sys.exit(main())
