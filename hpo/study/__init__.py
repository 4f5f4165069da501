"""A study: joining it, its budget, the worker's loop, retries, sampler and pruner, and the
retrain plan."""
