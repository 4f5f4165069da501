"""What a user reads about a study: status, best trials, the report."""
