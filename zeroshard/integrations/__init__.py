"""The two checkpoint routes frameworks give no other way into, one module per framework, each imported only when used.

Training needs no adapter: HF Trainer, accelerate, Lightning (``strategy="ddp"``) and Fabric run a
``ShardedOptimizer`` with their own code. ``zeroshard.integrations.hf`` (a ``TrainerCallback``) and
``zeroshard.integrations.accelerate`` (a ``save_state`` pre-hook) make their checkpoints whole;
Lightning gathers through ``consolidate_state_dict()`` itself. Each imports its framework
(``pip install 'zeroshard[integrations]'``); the core of zeroshard never does.
"""
