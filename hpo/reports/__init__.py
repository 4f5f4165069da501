"""What a user reads about a study: status and best trials, the report, the lines the read
commands print, and the worker's summary at the end of a run."""
