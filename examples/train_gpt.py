"""Train a small byte-level GPT with zeroshard.ShardedOptimizer on real text.

    torchrun --nproc_per_node 2 examples/train_gpt.py            # 3 to 5 minutes on 2 CPU cores
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 20 # seconds
    torchrun --nproc_per_node 2 examples/train_gpt.py --optimizer muon  # Muon on the hidden matrices, AdamW on the rest
    torchrun --nproc_per_node 2 examples/train_gpt.py --optimizer adamw8bit  # torchao's 8-bit AdamW (pip install torchao)
    torchrun --nproc_per_node 2 examples/train_gpt.py --ckpt-dir ckpt --steps 200
    torchrun --nproc_per_node 3 examples/train_gpt.py --ckpt-dir ckpt --steps 400 --resume  # on 3 ranks

The default corpus is the Python standard library's own source files on this machine (real text
nobody here wrote); ``--data FILE`` trains on any other file. Bytes are the tokens, so there is no
tokenizer to download. gloo on CPU, NCCL when CUDA is present. Rank 0 prints the loss and
tokens/s as it goes, the optimizer state each rank holds next to what the unsharded optimizers
would hold, the validation loss on held-out text before and after, and a final summary line.

``--optimizer muon`` trains with the Muon + AdamW recipe: ``torch.optim.Muon`` on the 2-D weight
matrices of the transformer blocks (attention and MLP), ``torch.optim.AdamW`` on the rest
(embeddings and the tied head, biases, norms), each in its own ``ShardedOptimizer``. Muon needs
each matrix whole, so its wrapper picks ``partition="param"`` (each matrix owned by one rank);
one LR schedule drives both, and ``zeroshard.clip_grad_norm_`` clips both by one global norm.

``--optimizer adamw8bit`` trains with torchao's ``AdamW8bit`` (moments kept as 8-bit codes with an
fp32 scale per block of 256 elements): its wrapper picks ``partition="param"``, so each param's
blocks are quantized as the unsharded optimizer would quantize them.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

import zeroshard

VOCAB = 256  # bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a bad value exits with argparse's usage error naming it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, default=2, choices=(1, 2), help="ZeRO stage")
    p.add_argument("--optimizer", choices=("adamw", "muon", "adamw8bit"), default="adamw",
                   help="adamw: AdamW on every param; muon: Muon on the blocks' weight matrices, AdamW on the rest; "
                        "adamw8bit: torchao's AdamW8bit on every param")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (the default takes 3 to 5 minutes on 2 CPU ranks)")
    p.add_argument("--data", type=Path, default=None, help="text file to train on (None: the stdlib sources)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    p.add_argument("--n-embd", type=int, default=128, help="model width (a multiple of --n-head)")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="param dtype (float16 turns on dynamic loss scaling)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="global gradient-norm clipping (0: off)")
    p.add_argument("--offload", choices=("cpu",), default=None, help="keep the fp32 master and Adam state in host memory")
    p.add_argument("--gpu-margin-mem-ratio", type=float, default=0.0,
                   help="with --offload: share of the first iteration's unused device memory that state may take back")
    p.add_argument("--log-interval", type=int, default=100, help="steps between progress lines")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches per rank for the validation loss")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initialization and of the batches")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="save a checkpoint under this directory every --ckpt-every steps")
    p.add_argument("--ckpt-every", type=int, default=None, help="steps between checkpoints (with --ckpt-dir; default there: 100)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in --ckpt-dir (any number of ranks)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "n_layer", "n_embd", "n_head", "log_interval", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if not args.lr > 0:
        p.error(f"--lr {args.lr}: must be positive")
    if not args.max_grad_norm >= 0:
        p.error(f"--max-grad-norm {args.max_grad_norm}: must be 0 (off) or positive")
    if not 0.0 <= args.gpu_margin_mem_ratio <= 1.0:
        p.error(f"--gpu-margin-mem-ratio {args.gpu_margin_mem_ratio}: must be between 0 and 1")
    if args.offload is not None and args.optimizer != "adamw":
        p.error(f"--offload {args.offload} keeps torch AdamW state only: it cannot be used with --optimizer {args.optimizer} "
                "(use --optimizer adamw)")
    if args.optimizer == "adamw8bit" and importlib.util.find_spec("torchao") is None:
        p.error("--optimizer adamw8bit needs torchao: pip install torchao")
    if args.gpu_margin_mem_ratio > 0 and args.offload is None:
        p.error("--gpu-margin-mem-ratio needs --offload cpu")
    if args.data is not None and not args.data.is_file():
        p.error(f"--data {args.data}: no such file")
    if args.ckpt_every is not None and args.ckpt_dir is None:
        p.error("--ckpt-every needs --ckpt-dir (where the checkpoints go)")
    if args.ckpt_every is not None and args.ckpt_every < 1:
        p.error(f"--ckpt-every {args.ckpt_every}: must be at least 1")
    if args.resume and args.ckpt_dir is None:
        p.error("--resume needs --ckpt-dir")
    args.ckpt_every = args.ckpt_every or 100
    return args


class Trained(NamedTuple):
    """One wrapped optimizer of the run, with what is saved and logged about it."""

    key: str  # its checkpoint key: "optim" (AdamW), "optim_muon"
    opt: zeroshard.ShardedOptimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    params: list[nn.Parameter]  # the model's params it updates
    unsharded_state_bytes: int  # what the unwrapped optimizer would hold on every rank (fp32 state)

    @property
    def schedule_key(self) -> str:
        """Its LR schedule's checkpoint key: "schedule", "schedule_muon"."""
        return self.key.replace("optim", "schedule")


def checkpoint_state(model: nn.Module, trained: list[Trained], step: int) -> dict:
    """What a checkpoint holds: the model, each optimizer and its LR schedule under their keys, the step."""
    state = {"model": model.state_dict(), "step": step}
    for t in trained:
        state |= {t.key: t.opt, t.schedule_key: t.schedule.state_dict()}
    return state


def save_checkpoint(directory: Path, step: int, model: nn.Module, trained: list[Trained]) -> None:
    """One torch.distributed.checkpoint directory per step; it counts only once its .metadata exists."""
    dcp.save(checkpoint_state(model, trained, step), checkpoint_id=directory / f"step_{step:06d}")


def load_checkpoint(directory: Path, model: nn.Module, trained: list[Trained]) -> int:
    """Load the latest complete checkpoint under ``directory`` (saved on any number of ranks); its step, or 0."""
    latest = zeroshard.latest_checkpoint(directory)
    if latest is None:
        return 0
    for t in trained:  # a damaged file or a reshaped param is named on every rank, before any collective
        zeroshard.verify_checkpoint(latest, t.opt, key=t.key)
    state = checkpoint_state(model, trained, 0)
    dcp.load(state, checkpoint_id=latest)
    model.load_state_dict(state["model"])
    for t in trained:
        t.schedule.load_state_dict(state[t.schedule_key])
    return state["step"]


# -- data -----------------------------------------------------------------------------------


def load_corpus(path: Path | None, max_bytes: int = 8 << 20) -> torch.Tensor:
    """1-D uint8 tensor of the training text: ``path``, or the stdlib's .py files (sorted, capped)."""
    if path is not None:
        data = path.read_bytes()[:max_bytes]
    else:
        chunks, total = [], 0
        for file in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            if "site-packages" in file.parts:
                continue
            text = file.read_bytes()
            chunks.append(text)
            total += len(text)
            if total >= max_bytes:
                break
        data = b"".join(chunks)[:max_bytes]
    if len(data) < 10_000:
        raise ValueError(f"--data {path} holds {len(data)} bytes; need at least 10000")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator, device: torch.device):
    """(inputs, targets), int64 [batch_size, seq_len], from random offsets into ``data``."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return window[:, :-1].to(device), window[:, 1:].to(device)


# -- model ----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2 style decoder over bytes; the output head is tied to the token embedding."""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, n_embd)
        self.pos = nn.Embedding(seq_len, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


# -- optimizers -----------------------------------------------------------------------------


def build_optimizers(model: GPT, args: argparse.Namespace) -> list[Trained]:
    """AdamW on every param (``--optimizer adamw``, or torchao's ``AdamW8bit``: ``adamw8bit``), or Muon on the blocks' weight
    matrices and AdamW on the rest.

    Each optimizer gets its own ``ShardedOptimizer`` (AdamW: ``partition="flat"``; Muon, which
    needs each matrix whole, and AdamW8bit, which quantizes whole params: ``partition="param"``,
    chosen by ``partition=None``) and its own
    LambdaLR with the same warmup and cosine decay, so one schedule drives both.
    """
    hidden = [p for block in model.blocks for p in block.parameters() if p.dim() == 2] if args.optimizer == "muon" else []
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    decay = [p for p in rest if p.dim() >= 2]
    no_decay = [p for p in rest if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optimizer == "adamw8bit":
        import torchao.optim

        adamw: torch.optim.Optimizer = torchao.optim.AdamW8bit(groups, lr=args.lr, betas=(0.9, 0.95))
    else:
        adamw = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    kind = "AdamW8bit" if args.optimizer == "adamw8bit" else "AdamW"
    # exp_avg, exp_avg_sq and step of each param, as the unsharded optimizer keeps them (one rank owns every param)
    unsharded = sum(zeroshard.estimate_memory(p.numel(), world_size=1, optimizer_class=kind).by_kind["optimizer_state"] for p in rest)
    wrapped = [("optim", adamw, rest, unsharded)]
    if hidden:
        # Moonlight's setting (Liu et al., "Muon is Scalable for LLM Training", 2025): the AdamW lr
        # and weight decay, with each matrix's update scaled by 0.2 * sqrt(max(rows, cols)) to match
        # AdamW's update RMS ("match_rms_adamw"), so --lr and the schedule tune both optimizers at
        # once; momentum 0.95 with Nesterov, torch's and modded-nanogpt's default.
        muon = torch.optim.Muon(hidden, lr=args.lr, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
        wrapped.append(("optim_muon", muon, hidden, sum(p.numel() * 4 for p in hidden)))  # momentum_buffer
    warmup = max(1, args.steps // 20)

    def lr_factor(s: int) -> float:
        return min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

    trained = []
    for key, optimizer, params, unsharded in wrapped:
        opt = zeroshard.ShardedOptimizer(optimizer, stage=args.stage, offload=args.offload, gpu_margin_mem_ratio=args.gpu_margin_mem_ratio)
        trained.append(Trained(key, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor), params, unsharded))
    return trained


def describe(t: Trained) -> str:
    """E.g. ``Muon on 16 params (0.79M): ShardedOptimizer(stage=2, partition='param'), rank 0 updates 8 of them whole (0.39M)``."""
    mine = [v for group in t.opt.param_groups for v in group["params"]]  # this rank's virtual params
    what = f"{len(mine)} of them whole" if t.opt.partition == "param" else "1-D slices of them"
    return (f"{type(t.opt.optimizer).__name__} on {len(t.params)} params ({sum(p.numel() for p in t.params) / 1e6:.2f}M): "
            f"ShardedOptimizer(stage={t.opt.stage}, partition={t.opt.partition!r}), rank {t.opt.rank} updates {what} "
            f"({sum(v.numel() for v in mine) / 1e6:.2f}M)")


# -- training -------------------------------------------------------------------------------


def setup() -> torch.device:
    """Join the torchrun group (or make a one-rank group, and say so, when run with plain python)."""
    launched = "RANK" in os.environ
    if not launched:
        print("not launched by torchrun: training on 1 rank "
              "(for 2: python -m torch.distributed.run --nproc_per_node 2 examples/train_gpt.py)", file=sys.stderr, flush=True)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    """Mean loss over ``eval_batches`` held-out batches per rank, averaged over ranks (same batches every call)."""
    model.eval()
    generator = torch.Generator().manual_seed(10_000 + dist.get_rank())
    losses = [model(*get_batch(data, args.batch_size, args.seq_len, generator, device)) for _ in range(args.eval_batches)]
    model.train()
    loss = torch.stack(losses).mean().reshape(1)
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def main() -> None:
    args = parse_args()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")

    data = load_corpus(args.data)
    split = int(len(data) * 0.95)
    train, val = data[:split], data[split:]
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model = GPT(args.n_layer, args.n_embd, args.n_head, args.seq_len).to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"corpus {len(data) / 2**20:.1f} MiB ({'stdlib sources' if args.data is None else args.data}), "
        f"model {n_params / 1e6:.2f}M params {args.dtype}, {world} ranks, ZeRO stage {args.stage}")

    trained = build_optimizers(model, args)
    opts = [t.opt for t in trained]
    for t in trained:
        log(describe(t))

    first_step = load_checkpoint(args.ckpt_dir, model, trained) + 1 if args.resume else 1
    if first_step > args.steps:
        dist.destroy_process_group()
        raise SystemExit(f"the checkpoint in {args.ckpt_dir} is at step {first_step - 1}, --steps {args.steps}: nothing left to train")
    if first_step > 1:
        log(f"resumed from {zeroshard.latest_checkpoint(args.ckpt_dir)} (step {first_step - 1}) on {world} ranks")
    val_before = evaluate(model, val, args, device)
    log(f"step {first_step - 1:5d} | val loss {val_before:.4f}")
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank + 7919 * first_step)
    tokens_per_step = args.batch_size * args.seq_len * world
    start = last = time.perf_counter()
    first_loss = loss_value = None
    for step in range(first_step, args.steps + 1):
        loss = model(*get_batch(train, args.batch_size, args.seq_len, generator, device))
        opts[0].backward(loss)  # scales the loss when a loss scale is active (fp16; all optimizers' scales are equal), else loss.backward()
        # One global norm over both optimizers' params, as torch.nn.utils.clip_grad_norm_ over the
        # model: it clips (inf: never), is the grad norm logged, and with fp16 makes one overflow
        # decision, so all of them skip the step together and their loss scales stay equal.
        zeroshard.clip_grad_norm_(opts, args.max_grad_norm or math.inf)
        for t in trained:
            t.opt.step()
            t.schedule.step()
        model.zero_grad()
        if args.ckpt_dir is not None and step % args.ckpt_every == 0:
            save_checkpoint(args.ckpt_dir, step, model, trained)
        if step == first_step:
            usages = [t.opt.memory_usage().by_kind for t in trained]
            names = " + ".join(type(opt.optimizer).__name__ for opt in opts)
            state = " + ".join(f"{u['optimizer_state'] / 2**20:.2f}" for u in usages)
            log(f"optimizer state per rank: {state} MiB (+ {sum(u['master'] for u in usages) / 2**20:.2f} MiB fp32 master); "
                f"unsharded {names} would hold {' + '.join(f'{t.unsharded_state_bytes / 2**20:.2f}' for t in trained)} MiB")
        if step % args.log_interval == 0 or step == args.steps or step == first_step:
            mean = loss.detach().float().reshape(1)
            dist.all_reduce(mean)
            loss_value = mean.item() / world
            first_loss = loss_value if first_loss is None else first_loss
            now = time.perf_counter()
            steps_done = args.log_interval if step % args.log_interval == 0 else 1
            scale = f" | loss scale {opts[0].loss_scale:g}" if opts[0].loss_scale else ""
            lr = trained[0].schedule.get_last_lr()[0]  # every optimizer's base lr is --lr, and one schedule drives them
            log(f"step {step:5d} | loss {loss_value:.4f} | grad norm {float(opts[0].grad_norm):.3f}{scale} | lr {lr:.2e} | "
                f"{steps_done * tokens_per_step / (now - last):,.0f} tokens/s")
            last = now
    elapsed = time.perf_counter() - start
    steps_run = args.steps - first_step + 1
    val_after = evaluate(model, val, args, device)
    log(f"step {args.steps:5d} | val loss {val_after:.4f}")
    log(f"done: {steps_run} steps in {elapsed:.1f} s ({steps_run * tokens_per_step / elapsed:,.0f} tokens/s), "
        f"train loss {first_loss:.3f} -> {loss_value:.3f}, val loss {val_before:.3f} -> {val_after:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # With torch 2.13 + gloo a rank sometimes aborts during interpreter shutdown, after a clean
    # destroy_process_group ("terminate called without an active exception"; plain DDP does it
    # too). Everything is done and flushed here, so skip the interpreter's finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
