import sys

from rbee_worker.cli import main

sys.exit(main())
