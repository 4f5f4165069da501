"""A study: joining it, its budget, the worker's loop, retries, sampler and pruner, the best
trials by hpo's rule (front.py) and the models it keeps (kept_models.py), and the retrain plan."""
