"""Saving the model while its params are views of flat buffers: ``opt.params_own_storage()``.

The real safetensors ``save_model``/``load_model`` and transformers ``save_pretrained``/
``from_pretrained`` of a tiny LLaMA built from a config (no download), at 2 ranks with stage 2;
the reference for the training that continues after the save is the same run without a save.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def _tiny_llama(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def _train(model, opt, steps: range) -> None:
    rank = torch.distributed.get_rank()
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, 256, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _are_views(opt) -> bool:
    return all(p.data_ptr() == s.buffer.param_view(i).data_ptr() for s in opt._shards for i, p in enumerate(s.buffer.params))


def save_worker(dtype: torch.dtype, directory: str | None) -> tuple[list[torch.Tensor], bool]:
    import safetensors.torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import zeroshard

    model = _tiny_llama(dtype)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), stage=2)
    _train(model, opt, range(3))
    if directory is not None:
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with opt.params_own_storage():
            if dist.get_rank() == 0:
                safetensors.torch.save_model(model, os.path.join(directory, "model.safetensors"))
                model.save_pretrained(os.path.join(directory, "hf"))
        dist.barrier()
        fresh = _tiny_llama(dtype)
        safetensors.torch.load_model(fresh, os.path.join(directory, "model.safetensors"))
        pretrained = LlamaForCausalLM.from_pretrained(os.path.join(directory, "hf")).to(dtype)  # bf16 -> fp32 -> bf16 is exact
        for loaded in (fresh.state_dict(), pretrained.state_dict()):
            assert loaded.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), key
        assert _are_views(opt)  # followed on leaving the block
    _train(model, opt, range(3, 6))
    return [p.detach().clone() for p in model.parameters()], _are_views(opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_inside_params_own_storage_then_training_continues_bitwise(pools, tmp_path, dtype):
    saved = pools[2].run(save_worker, dtype, str(tmp_path), timeout=240)
    unsaved = pools[2].run(save_worker, dtype, None, timeout=240)
    for (params, views), (reference, _) in zip(saved, unsaved):
        assert views
        assert all(torch.equal(a, b) for a, b in zip(params, reference))
