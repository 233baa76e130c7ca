"""otb_train: the parts of train.py, the reference RL trainer (``train.py`` itself is the loop).

The library a porter reads is :mod:`otb_ref`; this package is one trainer built on it:

* :mod:`otb_train.config` — every flag, validated in one place; run-directory checks.
* :mod:`otb_train.data` — ``--data`` files, synthetic tasks' problem stream, prompt ids.
* :mod:`otb_train.tasks` — synthetic tasks, their rewards, the math-answer reward, a character tokenizer.
* :mod:`otb_train.model` — the policy (LM head inside its forward, for FSDP2) and the tokenizer;
  :mod:`otb_train.tiny_models` — random-init causal LMs from sizes (the built-in model's, the tests' and the
  benchmarks' one recipe); :mod:`otb_train.warm_start` — the experiments' supervised warm start and sampler.
* :mod:`otb_train.rollout` — sampling with a KV cache (the reference sampler); :mod:`otb_train.static_decode` the
  fast static-cache decoder, tested equal to it.
* :mod:`otb_train.energies` — exact ``||S||²`` / ``||S_t||²`` for the "eob" and "otb_exact" estimators.
* :mod:`otb_train.losses` — the clipped policy-gradient loss, its aggregations, KL penalties.
* :mod:`otb_train.distributed` — torchrun, FSDP2, collectives; :mod:`otb_train.checkpoints` — DCP checkpoints;
  :mod:`otb_train.run_log` — metrics.jsonl and samples.jsonl.
"""
