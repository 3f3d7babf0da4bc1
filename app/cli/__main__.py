import sys

from app.cli.serve import main

sys.exit(main())
