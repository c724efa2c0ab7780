import sys

from draftwise.cli import main

sys.exit(main())
