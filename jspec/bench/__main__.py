import sys

from jspec.bench.cli import main

sys.exit(main())
