"""HF Trainer adapter: :class:`ShardedTrainer`, a ``transformers.Trainer`` that trains with a ``ShardedOptimizer``.

What the plain ``Trainer`` does around the optimizer, and what this changes:

* It wraps the model in DDP (``accelerator.prepare``) and moves it (``.to("cpu:0")``): the
  optimizer follows both by itself (it switches the DDP wrapper's reduction off and follows
  ``no_sync`` during gradient accumulation; see ``docs/design.md``). Nothing to change.
* It clips (``max_grad_norm``, default 1.0) and logs the gradient norm through
  ``accelerator.clip_grad_norm_``, i.e. ``torch.nn.utils.clip_grad_norm_`` on ``.grad``, which a
  ``ShardedOptimizer`` no longer holds: the accelerator here is a
  :class:`~zeroshard.integrations.accelerate.ShardedAccelerator`, whose ``clip_grad_norm_`` is
  ``opt.clip_grad_norm_(max_grad_norm)``.
* It saves ``optimizer.pt`` from rank 0 only (``optimizer.state_dict()``, that rank's shard): here
  every rank first gathers the full state onto rank 0 (``consolidate_state_dict``), so
  ``optimizer.pt`` holds the plain ``torch.optim`` format, which ``resume_from_checkpoint``
  loads on every rank, at any world size.
"""

from __future__ import annotations

try:
    import accelerate
    import transformers
except ModuleNotFoundError as error:  # an optional adapter: say how to get what it needs
    raise ModuleNotFoundError(f"{__name__} needs accelerate and transformers: pip install 'zeroshard[integrations]' ({error})") from error

from zeroshard.integrations.accelerate import ShardedAccelerator, check_one_writer, sharded_optimizers


class ShardedTrainer(transformers.Trainer):
    """``transformers.Trainer`` for ``optimizers=(ShardedOptimizer(...), scheduler)``: same arguments, same run.

    With any other optimizer it behaves as ``transformers.Trainer``.

    Raises:
        TypeError: the Trainer built an accelerator of another class than ``accelerate.Accelerator``
            (a Trainer subclass that overrides ``create_accelerator_and_postprocess``).
        ValueError: ``save_on_each_node=True`` with several nodes: the optimizer state is
            gathered onto rank 0 only.
    """

    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s own, then the accelerator becomes a :class:`ShardedAccelerator` (which adds methods only)."""
        super().create_accelerator_and_postprocess()
        if type(self.accelerator) is not accelerate.Accelerator:
            raise TypeError(f"ShardedTrainer expects the Trainer to build an accelerate.Accelerator, got {type(self.accelerator)!r}")
        self.accelerator.__class__ = ShardedAccelerator

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``Trainer``'s own, after gathering a ``ShardedOptimizer``'s full state onto rank 0 (a collective)."""
        sharded = sharded_optimizers([self.optimizer])
        if sharded:
            check_one_writer(self.args.save_on_each_node, self.args.world_size)
        for opt in sharded:
            opt.consolidate_state_dict(to=0)
        super()._save_optimizer_and_scheduler(output_dir)
