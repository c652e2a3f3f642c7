"""What a run records and shows: metrics files, progress, summaries."""
