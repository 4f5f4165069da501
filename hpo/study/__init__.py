"""A study: opening it, its budget, ask and tell, retries, sampler and pruner."""
