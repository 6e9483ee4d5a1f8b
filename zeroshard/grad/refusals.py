"""The errors raised where user code did to the gradients what zeroshard cannot follow as DDP would (``docs/design.md``, "What
user code does to the params and gradients"): each says why and the way out."""

from __future__ import annotations

from torch import nn


def sparse_gradient(param: nn.Parameter) -> RuntimeError:
    """The error for a sparse gradient of ``param`` (``nn.Embedding(sparse=True)``), which zeroshard does not reduce."""
    return RuntimeError(f"param {tuple(param.shape)} got a sparse gradient; zeroshard reduces dense gradients only (use sparse=False in nn.Embedding)")


def read_inside_no_sync() -> RuntimeError:
    """The error for a read of ``opt.param_groups``' gradients inside ``opt.no_sync()``, which reduces only at the block's end."""
    return RuntimeError("a torch function on opt.param_groups' .grad inside opt.no_sync(): they hold the reduced gradient, which "
                        "the block has not made yet (DDP's .grad there is each rank's own: read the model's params' .grad), and "
                        "reducing now would differ between ranks that run more backward passes in the block; read them after it")


def unfrozen_under_no_sync() -> RuntimeError:
    """The error for a read of ``opt.param_groups``' gradients that would leave out params unfrozen since the last reduction."""
    return RuntimeError("params unfrozen inside no_sync() got gradients under it only, so a read of opt.param_groups' .grad (a "
                        "clip, GradScaler's check) listed its params before they were sharded into it (DDP's includes them); unfreeze "
                        "before the no_sync() block, clip with opt.clip_grad_norm_, or run the last backward outside no_sync()")


def edited_after_reduction() -> RuntimeError:
    """The error for gradients edited in place between a reduction and a later backward of the same step."""
    return RuntimeError(
        "the gradients (the params' .grad, or opt.param_groups' .grad) were edited in place after zeroshard reduced them, "
        "and another backward now adds to them: ZeRO stage 1 reduces the running local sum again, which would drop the "
        "edit, and after a no_sync() micro-step DDP would have edited each rank's own gradient. Edit gradients after the "
        "last backward of the step (accumulate micro-steps with opt.no_sync())")


def edited_before_reduction() -> RuntimeError:
    """The error for gradients accumulated under ``no_sync()`` and edited in place before the ``step()`` that reduces them."""
    return RuntimeError(
        "the params' .grad were modified in place after a backward under no_sync() and before they were reduced "
        "(torch.nn.utils.clip_grad_norm_ or a framework's clipping?): they hold this rank's own gradient, so each rank "
        "changed its own where DDP changes the average. Run the last micro-batch's backward outside no_sync() (its end "
        "reduces: .grad then holds DDP's averaged gradient), or clip with opt.clip_grad_norm_(...) or max_grad_norm")
