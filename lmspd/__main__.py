import sys

from lmspd.cli import main

sys.exit(main())
