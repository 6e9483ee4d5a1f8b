"""HF Trainer: the plain ``transformers.Trainer`` trains a ``ShardedOptimizer``; :class:`GatherOptimizerOnSave` makes its
checkpoints whole (docs/integrations.md, "HF Trainer": what the ``Trainer`` does around the optimizer, all followed)::

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

    The Trainer saves ``optimizer.pt`` from rank 0 only, as ``optimizer.state_dict()``: rank 0's shard. So at the end of a
    step or epoch where it is about to save (``control.should_save``, set by ``save_strategy``/``save_steps``), every rank
    calls ``opt.consolidate_state_dict(to=0)`` (a collective: the Trainer runs callbacks on every rank), and rank 0 writes
    the full ``torch.optim`` format, which ``resume_from_checkpoint`` loads at any world size. With ``save_strategy="best"``
    the Trainer decides to save after the evaluation and its callbacks, so the state is gathered in ``on_evaluate`` when the
    metrics beat the best so far (the Trainer's own test). With any other optimizer it does nothing.

    Raises:
        ValueError: ``save_on_each_node=True`` on several nodes: the state is gathered onto rank 0
            only, and the other nodes' files would hold their own shards.
    """

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if control.should_save:
            _gather(args, optimizer)

    on_epoch_end = on_step_end

    def on_evaluate(self, args: Any, state: Any, control: Any, optimizer: Any = None, metrics: Any = None, **kwargs: Any) -> None:
        # save_strategy="best": Trainer._maybe_log_save_evaluate sets should_save after this callback, from the metrics
        if args.save_strategy == "best" and _new_best(args, state, metrics or {}):
            _gather(args, optimizer)


def _new_best(args: Any, state: Any, metrics: dict[str, float]) -> bool:
    """Whether ``metrics`` beat ``state.best_metric`` (not yet updated when ``on_evaluate`` runs), so the Trainer saves after
    this evaluation under ``save_strategy="best"``: ``Trainer._determine_best_metric``'s test. Of several eval datasets only the
    one whose metrics hold ``metric_for_best_model`` counts."""
    name = args.metric_for_best_model
    if name is None:  # the Trainer never finds a new best
        return False
    key = name if name.startswith("eval_") else f"eval_{name}"
    if key not in metrics:
        return False
    if args.greater_is_better:
        return metrics[key] > (float("-inf") if state.best_metric is None else state.best_metric)
    return metrics[key] < (float("inf") if state.best_metric is None else state.best_metric)


def _gather(args: Any, optimizer: Any) -> None:
    """Gather ``optimizer``'s full state onto rank 0 if it is a ``ShardedOptimizer`` and the checkpoint saves it (not with
    ``save_only_model``; see :class:`GatherOptimizerOnSave`)."""
    opt = _sharded(optimizer)
    if opt is None or args.save_only_model:
        return
    nodes = args.world_size // max(1, int(getattr(args, "local_world_size", 0) or args.world_size))
    if args.save_on_each_node and nodes > 1:
        raise ValueError(f"save_on_each_node=True on {nodes} nodes: a ShardedOptimizer's state is gathered onto rank 0 only, whose "
                         "file the other nodes would lack; set save_on_each_node=False")
    opt.consolidate_state_dict(to=0)
