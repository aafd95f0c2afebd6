"""``python -m trainer.plan``: the command keeps its name; the code lives in ``trainer.estimate.plan``."""
import sys

from trainer.estimate import plan

if __name__ == "__main__":
    sys.exit(plan.main())
