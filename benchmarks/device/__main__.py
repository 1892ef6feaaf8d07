"""``python -m benchmarks.device --help`` lists the stages."""

import sys

from .cli import main

sys.exit(main())
