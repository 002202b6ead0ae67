"""`python -m trl_lopti ...` runs the `trl-lopti` command line (also under `accelerate launch -m trl_lopti ...`)."""

import sys

from .cli.main import main


if __name__ == "__main__":
    sys.exit(main())
