"""llamarl executors and the code they share."""
