"""Thin framework integrations: otb_ref's estimators inside trainers people already run.

* :mod:`otb_ref.integrations.verl` — a verl plugin (entry point ``verl.plugins``): ``algorithm.adv_estimator=
  otb_ref.<name>`` selects any estimator of :data:`otb_ref.ESTIMATORS` that verl can feed.
* :mod:`otb_ref.integrations.trl` — ``OTBGRPOTrainer``, TRL's ``GRPOTrainer`` with token-level advantages.

Each refuses at construction what it cannot honour. docs/PORTING.md has the recipes.
"""
