import sys

from rl360.cli import main

sys.exit(main())
