import sys

from duplex.cli import main

sys.exit(main())
