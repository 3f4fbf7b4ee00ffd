import sys

from gem_model.cli import main

sys.exit(main())
