"""sloth under PyTorch's own distributed engines on the CPU: FSDP2 (``fully_shard``) and DDP, two processes on
the gloo backend, a tiny Llama with peft LoRA. Each rank trains on its half of a batch; the gradients (averaged
over the ranks by FSDP2's reduce-scatter and DDP's all-reduce, gathered whole) must equal eager's averaged
gradients under the whole-model tolerance rule, and each rank's report must count the sites a single-process
compile counts (under FSDP2 less the causal masks, each reported; with each layer compiled on its own, as
torchtitan does, less what runs outside the layers: see the test). Under FSDP2's mixed precision (bf16 compute,
fp32 reduction) the same policy run eagerly on the two ranks is the rule's "eager", at bf16's precision.
"""
from __future__ import annotations

import os
import socket
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sloth
from test_models import assert_model_close

pytest.importorskip("peft")
WORLD = 2
VOCAB = 96


def tiny_lora_llama() -> torch.nn.Module:
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = get_peft_model(transformers.LlamaForCausalLM(config),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # nonzero B: gradients reach every adapter and the input
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model


def batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (WORLD, 2, 10), generator=torch.Generator().manual_seed(1))


def _name(name: str) -> str:
    return name.replace("_orig_mod.", "").replace("module.", "")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[_name(name)] = g.detach().clone()
    return out


# fsdp2: fully_shard per layer and on the root, the whole model compiled; fsdp2-per-layer: torchtitan's recipe, each
# decoder layer compiled on its own and then sharded (the embedding, the final norm and the loss run eagerly).
# fsdp2-bf16: FSDP2's mixed precision (bf16 compute, fp32 gradient reduction and parameters), whole model compiled,
# held to the same policy run eagerly on the two ranks (fsdp2-bf16-eager, the rule's "eager").
ENGINES = ("fsdp2", "fsdp2-per-layer", "ddp", "fsdp2-bf16", "fsdp2-bf16-eager")


def _worker(rank: int, port: int, out: str) -> None:
    """Both engines in turn in one pair of processes (a process start costs ~15 s of imports here)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for engine in ENGINES:
            torch._dynamo.reset()
            sloth.reset_report()
            model = tiny_lora_llama()
            options = {"inner": "aot_eager"}
            if engine.startswith("fsdp2"):
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                    if "bf16" in engine else MixedPrecisionPolicy()
                layers = model.base_model.model.model.layers
                for i, layer in enumerate(layers):
                    if engine == "fsdp2-per-layer":
                        layer = layers[i] = torch.compile(layer, backend="sloth", options=options)
                    fully_shard(layer, mp_policy=policy)
                fully_shard(model, mp_policy=policy)
            else:
                model = torch.nn.parallel.DistributedDataParallel(model)
            eager = engine in ("fsdp2-per-layer", "fsdp2-bf16-eager")
            compiled = model if eager else torch.compile(model, backend="sloth", options=options)
            ids = batches()[rank]
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            grads = _grads(model)
            losses = [torch.zeros(()) for _ in range(WORLD)]
            dist.all_gather(losses, loss.detach())
            report = sloth.report()
            results[engine] = {"losses": losses, "grads": grads, "counts": dict(report.counts),
                               "graphs": report.graphs, "unexplained": report.unexplained,
                               "rejections": [(r.family, r.module, r.reason) for r in report.rejections]}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eager_average(dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean loss and gradients over the ranks' batches, one process, eager, at ``dtype``."""
    model = tiny_lora_llama().to(dtype)
    total: dict[str, torch.Tensor] = {}
    losses = []
    for ids in batches():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        for name, p in model.named_parameters():
            if p.grad is not None:
                total[name] = total.get(name, 0) + p.grad.detach() / WORLD
    return torch.stack(losses).mean(), total


def test_two_ranks_match_eager_under_fsdp2_and_ddp(tmp_path):
    # One test, not one per engine: both engines run in one pair of processes, which pytest-xdist would
    # otherwise start once per worker.
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(_free_port(), out), nprocs=WORLD, start_method="spawn", join=True)
    results = torch.load(out)
    eager, reference = _eager_average(torch.float32), _eager_average(torch.float64)
    single = tiny_lora_llama()  # the sites a single-process compile replaces
    sloth.reset_report()
    ids = batches()[0]
    torch.compile(single, backend="sloth", options={"inner": "aot_eager"})(input_ids=ids, labels=ids)
    single_counts = dict(sloth.report().counts)
    bf16_eager = results["fsdp2-bf16-eager"]
    bf16_eager = (torch.stack(bf16_eager["losses"]).mean().float(), bf16_eager["grads"])
    for engine in ENGINES[:-1]:
        result = results[engine]
        loss = torch.stack(result["losses"]).mean()
        assert set(result["grads"]) == set(eager[1]), (engine, sorted(set(result["grads"]) ^ set(eager[1])))
        if engine == "fsdp2-bf16":  # bf16 compute: against the same policy run eagerly, at bf16's precision
            assert all(g.dtype == torch.float32 for g in result["grads"].values())  # reduced and kept in fp32
            assert_model_close((loss.float(), result["grads"]), bf16_eager, reference, torch.bfloat16)
        else:
            assert_model_close((loss, result["grads"]), eager, reference, torch.float32)
        expected = dict(single_counts)
        if engine == "fsdp2-per-layer":
            # Outside the compiled layers: the final norm and the lm_head with its loss (eager), and the mask: built
            # eagerly, transformers hands SDPA no mask and is_causal (no site to find).
            expected["rms_norm"] -= 1
            for family in ("cross_entropy", "causal_mask"):
                expected.pop(family)
            assert not result["rejections"], result["rejections"]
        elif engine in ("fsdp2", "fsdp2-bf16"):
            # Known gap (issue 21): Dynamo breaks the graph at each fully_shard module, so each layer's graph
            # receives transformers' causal mask as an input, which the causal-mask family cannot prove causal at
            # compile time; every such site is reported with that reason, and attention runs masked.
            lost = expected.pop("causal_mask")
            kept = [r for r in result["rejections"] if r[0] == "causal_mask"]
            assert len(kept) == lost and all("graph input" in r[2] for r in kept), result["rejections"]
        assert result["counts"] == expected, (engine, result["counts"], expected, result["rejections"])
        assert not result["unexplained"], (engine, result["unexplained"])
