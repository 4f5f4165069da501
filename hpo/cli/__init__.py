"""The `hpo` command line: arguments (parser.py), the dispatch of a command and its exit code
(app.py). What each command does lives in hpo.commands; what the read commands print, in
hpo.reports.
"""

from hpo.cli.app import main
from hpo.cli.parser import build_parser

__all__ = ["build_parser", "main"]
