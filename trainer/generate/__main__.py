"""``python -m trainer.generate``: see ``trainer.generate.cli``."""
import sys

from trainer.generate.cli import main

if __name__ == "__main__":
    sys.exit(main())
