"""``python -m tools.mutation ...``: the driver in ``run.py``."""
from .run import main

raise SystemExit(main())
