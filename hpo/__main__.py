"""Allows `python -m hpo`."""

from hpo.cli import main

raise SystemExit(main())
