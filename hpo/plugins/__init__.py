"""The plug-in surface: the user's code that a config names by import path (a training
function, a task class, a metrics function, a define-by-run search space, a model factory),
how hpo imports and checks it, and what hpo hands it (TrainingContext). Users import these
names from `hpo`; the modules here may move."""
