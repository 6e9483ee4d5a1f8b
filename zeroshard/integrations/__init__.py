"""What frameworks give no other way into, one module per framework, each imported only when used: the checkpoint routes of
HF Trainer (``hf``) and accelerate (``accelerate``), Lightning's finetuning callbacks (``lightning``); the core of zeroshard
never imports a framework (docs/integrations.md)."""
