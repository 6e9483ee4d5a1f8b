"""``ShardedOptimizer``'s checkpoint API (:class:`StateDictMixin`); the formats, one :class:`CheckpointFormat` per partition
mode, live in ``zeroshard/checkpoint/``."""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zeroshard.checkpoint import full, sharded, whole_param
from zeroshard.comm import collectives
from zeroshard.step.fused_adam import fused_refusal
from zeroshard.update import UpdateMixin


@dataclass(frozen=True)
class CheckpointFormat:
    """The two checkpoint formats of one partition mode, as the functions that make and load them."""

    sharded_state_dict: Callable[[sharded.CheckpointView], dict[str, Any]]  # this rank's shard (the per-rank state_dict(), DCP's)
    load_sharded: Callable[[sharded.CheckpointView, dict[str, Any], bool], sharded.Loaded]  # (view, state_dict, filled_in_place)
    consolidate: Callable[[sharded.CheckpointView, int], dict[str, Any] | None]  # the full format on rank `to` (None elsewhere); a collective


FORMATS = {  # by ShardedOptimizer.partition; the full format loads through full.load_full for both
    "flat": CheckpointFormat(sharded.sharded_state_dict, sharded.load_sharded, full.consolidate),
    "param": CheckpointFormat(whole_param.sharded_state_dict, whole_param.load_sharded, whole_param.consolidate),
}


class StateDictMixin(UpdateMixin):
    """Checkpoint methods of :class:`~zeroshard.ShardedOptimizer` (see ``docs/checkpoint.md``)."""

    # What the host (ShardedOptimizer) provides, beyond what UpdateMixin declares.
    partition: str
    _consolidated: dict[str, Any] | None  # the full state, on the rank that ran consolidate_state_dict
    _since_consolidation: bool  # every rank: a consolidate_state_dict() since the last step
    _issued: dict[int, weakref.ref]  # id -> tensor, for those the last state_dict() returned
    _issued_shards = 0  # how many shards the optimizer had then
    wait_params: Callable[[], None]
    _optimizer_state_dict_pre_hooks: OrderedDict
    _optimizer_state_dict_post_hooks: OrderedDict
    _optimizer_load_state_dict_pre_hooks: OrderedDict
    _optimizer_load_state_dict_post_hooks: OrderedDict

    def __getstate__(self) -> dict[str, Any]:
        """Refuse ``pickle``, ``torch.save(opt)``, ``copy.copy`` and ``copy.deepcopy`` (which ``torch.optim.Optimizer`` allows):
        a copy would hold process groups, autograd hooks and views of the model's flat buffers, and its load failed far from
        the save (``AttributeError: ... no attribute 'optimizer'``).

        Raises:
            TypeError: always, naming what to save or copy instead.
        """
        raise TypeError("a ShardedOptimizer cannot be pickled or copied (it holds process groups, hooks and views of the model's flat "
                        "buffers): save its state with opt.state_dict() (docs/checkpoint.md) and build a new one to load it into; a copy "
                        "of the model (an EMA, a teacher) takes copy.deepcopy(model)")

    def checkpoint_view(self) -> sharded.CheckpointView:
        """What this optimizer's checkpoints record of it (layout, param groups, steps, mesh, loss scaler), for the checks of a load."""
        self._settle()
        return sharded.CheckpointView(self.optimizer, self._shards, self._shard_set.group_params, self._shard_set.param_steps,
                                      self.groups.mesh, self.process_group, self.partition, self._scaler, self._timeout)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state: this rank's shard, or the full state right after consolidation.

        Runs no collective (HF Trainer and accelerate call it on one rank). The first call on the rank that just ran
        :meth:`consolidate_state_dict` (before any ``step()``) returns the full state in plain ``torch.optim`` format, as
        ``ZeroRedundancyOptimizer``'s does. Every other call returns the sharded format, which
        ``torch.distributed.checkpoint`` reshards onto any world size: per bucket, a 1-D ``DTensor`` of each per-element
        state (and of the fp32 master), or with ``partition="param"`` each owned param's state tensors whole; with the param
        groups, per-param steps and a layout signature (``docs/checkpoint.md``). The tensors are copies, zero-filled in a
        freshly built optimizer (no dummy step): loading into them never touches the optimizer until
        :meth:`load_state_dict`. From a consolidation to the next step it also holds a one-element-per-rank marker, so that
        a ``dcp.save`` made before rank ``to`` took its full state fails on every rank ("Failed to validate global plan")
        rather than write a checkpoint without that rank's shard. Hooks registered with
        ``register_state_dict_pre_hook``/``register_state_dict_post_hook`` run as in ``torch.optim.Optimizer.state_dict`` (a
        post hook may return a replacement).

        Raises:
            ValueError: the wrapped optimizer keeps scalar state other than ``step``.
        """
        self.wait_params()
        self._settle()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        if self._consolidated is not None:
            state_dict, self._consolidated = self._consolidated, None
        else:
            state_dict = FORMATS[self.partition].sharded_state_dict(self.checkpoint_view())
            self._issued = {id(t): weakref.ref(t) for t in sharded.issued_tensors(state_dict)}
            self._issued_shards = len(self._shards)
            if self._since_consolidation:  # a dcp.save now fails unless rank `to` has taken its full state
                state_dict["zeroshard"]["consolidation"] = sharded.consolidation_marker(self.groups.mesh)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state onto global rank ``to``, one bucket at a time (``partition="param"``: one param's state at a time).

        A collective: call it on every rank. Afterwards :meth:`state_dict` on rank ``to`` returns the full state in
        plain ``torch.optim`` format — param-shaped state keyed by the wrapped optimizer's param indices, every
        hyperparameter, and a ``"zeroshard"`` entry (param shapes and dtypes, fp32 masters of 16-bit params) that plain
        torch ignores — once, which loads into an unsharded optimizer of the same class, or into a ``ShardedOptimizer``
        at any world size. Mirrors ``ZeroRedundancyOptimizer.consolidate_state_dict``.

        Raises:
            ValueError: (on every rank) ``to`` not the same on every rank, or not a rank of the world.
            RuntimeError: with ``collective_timeout_s``, some rank did not call it in time (a rank-0-only call).
        """
        self.wait_params()
        self._settle()
        # A rank gathering to another `to` would wait for sends that never come; compared before the range check, so that a
        # bad `to` on one rank raises on every rank.
        self.groups.check_each(lambda group: collectives.check_same_on_all_ranks(
            "consolidate_state_dict argument", [("to", to)], group, remedy="pass the same to= on every rank", timeout=self._timeout,
            caller="consolidate_state_dict()"), self._timeout, "consolidate_state_dict()")
        if not 0 <= to < dist.get_world_size():
            raise ValueError(f"to={to} is not a rank of the world (size {dist.get_world_size()})")
        self._consolidated = FORMATS[self.partition].consolidate(self.checkpoint_view(), to)
        self._since_consolidation = True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a sharded state dict (this layout, any world size via DCP) or a full one (any world size).

        Accepts what :meth:`state_dict` returns — filled by ``dcp.load`` at any world size, or saved with ``torch.save`` at
        this same world size — and full ``torch.optim``-format dicts: from :meth:`consolidate_state_dict` or from an
        unsharded optimizer of the same class on the same params. The checkpoint's hyperparameters win, as in
        ``torch.optim``: the state it must hold is what they keep (an ``SGD(momentum=0.9)`` dict loads into an optimizer
        built as ``SGD(lr=0.01)``). Afterwards the state is exactly the loaded one: params without state in the dict have
        none, and 16-bit params whose fp32 master the dict lacks take their current value as master. Runs no collective,
        unless the dict holds params unfrozen since the optimizer was built and not yet sharded (saved after the same
        unfreezing): it shards them first, as the next backward would (every rank loads). Everything is checked before
        anything is written, so on error the optimizer is as it was (those params sharded). Hooks registered with
        ``register_load_state_dict_pre_hook``/``register_load_state_dict_post_hook`` run as in
        ``torch.optim.Optimizer.load_state_dict`` (a pre hook may return a replacement).

        Raises:
            ValueError: anything else, or a state dict for another model (group count, param count, shape or dtype: the
                param is named as ``param_groups[g]['params'][j]`` with both shapes), state that the checkpoint's
                hyperparameters do not keep (another optimizer's), settings the fused Adam/AdamW update chosen at
                construction does not take (``amsgrad``, ``capturable``, ``differentiable``, a tensor ``lr``), another ``bucket_size_mb``, a sharded dict from
                another world size not loaded through DCP, or one saved by an older zeroshard.
        """
        self.wait_params()
        self._settle()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        if self._holds_unfrozen(state_dict) and self._shard_unfrozen():  # as the next backward would: the layout is the saver's
            self._reducer.accumulate_locally()
        view = self.checkpoint_view()
        meta = state_dict.get("zeroshard") if isinstance(state_dict, dict) else None
        if isinstance(meta, dict) and meta.get("format") == sharded.SHARDED_FORMAT:
            tensors = sharded.issued_tensors(state_dict)
            filled_in_place = bool(tensors) and all(self._issued.get(id(t), lambda: None)() is t for t in tensors)
            if filled_in_place and len(self._shards) > self._issued_shards:  # sharded just now: DCP filled no entry for them
                names = [name for shard in self._shards[self._issued_shards :] for name in shard.buffer.names]
                raise ValueError(f"the state_dict() that dcp.load filled was taken before params unfrozen since the optimizer was built ({names}) "
                                 "were sharded, which this load did (the checkpoint's layout has them), so it holds nothing of theirs. Take "
                                 "opt.state_dict() again and dcp.load into it (dcp.load({'optim': opt}): call it again); or shard them before "
                                 "taking it (a backward or a no_sync() block does)")
            inner, steps, masters = FORMATS[self.partition].load_sharded(view, state_dict, filled_in_place)
        elif isinstance(state_dict, dict) and (meta is None or (isinstance(meta, dict) and meta.get("format") == sharded.FULL_FORMAT)):
            state_dict = full.unnested(self.optimizer, state_dict)  # bitsandbytes' own state_dict() nests its state
            inner, steps, masters = full.load_full(view, state_dict)
        else:
            raise ValueError(f"state_dict is neither a zeroshard state dict nor a torch.optim one (zeroshard entry: {meta!r})")
        if self._fused is not None and (refused := fused_refusal(inner["param_groups"])) is not None:
            raise ValueError(f"state_dict: {refused}, which the fused Adam/AdamW update this ShardedOptimizer chose at construction "
                             f"cannot run (torch's {type(self.optimizer).__name__} would switch to its own update); build the torch "
                             "optimizer with the checkpoint's settings, wrap that, then load")
        self.optimizer.load_state_dict(inner)
        if self._fused is not None:
            self._fused.load(self._shards)
        with torch.no_grad():
            for k, offset, values in masters:
                self._shards[k].master_view(offset, values.numel()).copy_(values)
        self._shard_set.param_steps[:] = steps
        scaler_state = (state_dict.get("zeroshard") or {}).get("loss_scaler")
        if self._scaler is not None and scaler_state is not None:
            self._scaler.load_state_dict(scaler_state)
        self._consolidated = None  # the marker stays until step(), a collective: a load on some ranks only must not end it
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _holds_unfrozen(self, state_dict: Any) -> bool:
        """Whether ``state_dict`` holds params unfrozen since this optimizer was built and not sharded yet (in a sharded
        dict's layout, or with state in a full one), which the load must shard first; the same on every rank when every rank
        unfroze the same params (as training needs) and loads the same checkpoint."""
        unfrozen = self._shard_set.unfrozen()
        if not unfrozen or not isinstance(state_dict, dict):
            return False
        meta = state_dict.get("zeroshard")
        if isinstance(meta, dict) and meta.get("format") == sharded.SHARDED_FORMAT:
            saved = {name for _, params, _ in meta.get("layout", []) for name, _ in params}
            return any(name in saved for _, name in unfrozen)
        state = state_dict.get("state")
        return isinstance(state, dict) and any(state.get(index) for index, _ in unfrozen)

    @contextlib.contextmanager
    def params_own_storage(self) -> Iterator[None]:
        """Context manager: inside, every trainable param has storage of its own, for saving the model.

        The params are views of flat buffers (see ``docs/design.md``), so they share one storage:
        ``safetensors.torch.save_model`` refuses to save ("None is covering the entire storage"), ``torch.save`` of any
        part of ``model.state_dict()`` writes the whole flat buffer, padding included, and a shared-tensor check (older
        ``transformers``' ``save_pretrained``) may take all params for tied weights. Inside the block each param is a copy
        of itself (the model's bytes once more on its device); on exit each becomes a view of its flat buffer again, taking
        its current values (``FlatParamBuffer.follow``); bf16/fp16 masters keep their fp32 precision wherever the param
        value is unchanged. Runs no collective and changes no value; tied params stay one tensor. Do not train inside the block.

        Example::

            with opt.params_own_storage():
                safetensors.torch.save_model(model, "model.safetensors")

        Raises:
            RuntimeError: on exit, a param that was moved to another device or cast to another
                dtype inside the block (named), as at the next ``step()``.
        """
        with torch.no_grad():
            for shard in self._shards:
                for param in shard.buffer.params:
                    param.data = param.data.clone()
        try:
            yield
        finally:
            for shard in self._shards:
                shard.follow_all()

    def holds_storage_of(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` shares storage with one of this optimizer's flat param buffers (every trainable param does, see :meth:`params_own_storage`)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(shard.buffer.data.untyped_storage().data_ptr() == ptr for shard in self._shards)
