"""``python -m experiments.learning``: runs :func:`experiments.learning.experiment.main`."""

import sys

from experiments.learning.experiment import main

sys.exit(main())
