"""`python -m model_worker.weights import ...`: the import's command line (`model_worker/weights/cli.py`)."""

from model_worker.weights.cli import main

raise SystemExit(main())
