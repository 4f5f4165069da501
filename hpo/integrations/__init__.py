"""hpo around other libraries' training loops: `hpo.integrations.transformers` tunes a
transformers Trainer script on hpo's workers. Nothing here loads at `import hpo`.
"""
