"""``python -m trainer.plot``: the command keeps its name; the code lives in ``trainer.observe.plot``."""
import sys

from trainer.observe import plot

if __name__ == "__main__":
    sys.exit(plot.main())
