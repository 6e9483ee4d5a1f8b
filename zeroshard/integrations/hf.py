"""HF Trainer: the plain ``transformers.Trainer`` trains a ``ShardedOptimizer``; :class:`GatherOptimizerOnSave` makes its checkpoints whole.

What the ``Trainer`` does around the optimizer, all followed with no adapter:

* It wraps the model in DDP (``accelerator.prepare``) and moves it (``.to("cpu:0")``): the
  optimizer adopts the wrapper before its first forward (DDP then reduces nothing; zeroshard
  follows ``no_sync`` during gradient accumulation) and follows the move (``docs/design.md``).
* It clips (``max_grad_norm``) and logs ``grad_norm`` through ``accelerator.clip_grad_norm_``,
  i.e. ``torch.nn.utils.clip_grad_norm_`` on the model's ``.grad``: ``ShardedGrad`` s, which
  answer as DDP's averaged gradients (``zeroshard/grad/sharded_grad.py``).

The one thing it gives no other way into: it saves ``optimizer.pt`` from rank 0 only, as
``optimizer.state_dict()``, which for a ``ShardedOptimizer`` is rank 0's shard. The callback
gathers every rank's state onto rank 0 first (``consolidate_state_dict``), so ``optimizer.pt``
holds the plain ``torch.optim`` format that ``resume_from_checkpoint`` loads on every rank, at any
world size::

    trainer = Trainer(model=model, args=args, optimizers=(zeroshard.ShardedOptimizer(opt), None),
                      callbacks=[GatherOptimizerOnSave()])
"""

from __future__ import annotations

from typing import Any

try:
    import transformers
except ModuleNotFoundError as error:  # an optional adapter: say how to get what it needs
    raise ModuleNotFoundError(f"{__name__} needs transformers: pip install 'zeroshard[integrations]' ({error})") from error

from zeroshard.optimizer import ShardedOptimizer


def _sharded(optimizer: Any) -> ShardedOptimizer | None:
    """The ``ShardedOptimizer`` inside accelerate's ``AcceleratedOptimizer`` (``.optimizer``), or ``None``."""
    for _ in range(4):
        if isinstance(optimizer, ShardedOptimizer) or optimizer is None:
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class GatherOptimizerOnSave(transformers.TrainerCallback):
    """A ``TrainerCallback``: before each checkpoint, gather a ``ShardedOptimizer``'s full state onto rank 0.

    At the end of a step or epoch where the Trainer is about to save (``control.should_save``, set
    by ``save_strategy``/``save_steps``), every rank calls ``opt.consolidate_state_dict(to=0)`` (a
    collective: the Trainer runs callbacks on every rank), so the ``optimizer.pt`` that rank 0 writes
    is the full ``torch.optim`` format. With any other optimizer it does nothing.

    Raises:
        ValueError: ``save_on_each_node=True`` on several nodes: the state is gathered onto rank 0
            only, and the other nodes' files would hold their own shards.
    """

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._gather(args, control, optimizer)

    def on_epoch_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._gather(args, control, optimizer)

    @staticmethod
    def _gather(args: Any, control: Any, optimizer: Any) -> None:
        opt = _sharded(optimizer)
        if opt is None or not control.should_save:
            return
        nodes = args.world_size // max(1, int(getattr(args, "local_world_size", 0) or args.world_size))
        if args.save_on_each_node and nodes > 1:
            raise ValueError(f"save_on_each_node=True on {nodes} nodes: a ShardedOptimizer's state is gathered onto rank 0 only, whose "
                             "file the other nodes would lack; set save_on_each_node=False")
        opt.consolidate_state_dict(to=0)
