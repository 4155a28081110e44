"""sloth under PyTorch's own distributed engines on the CPU: FSDP2 (``fully_shard``) and DDP, two processes on
the gloo backend, a tiny Llama and a tiny Qwen3 with peft LoRA, FSDP2 also over gradient-checkpointed layers, both
also with Inductor inside; transformers' Trainer under ``torchrun`` (DDP); and a peft QLoRA model (bitsandbytes 4-bit
bases stored as float32) under FSDP2. Each rank trains on its half of a batch; the gradients (averaged
over the ranks by FSDP2's reduce-scatter and DDP's all-reduce, gathered whole) must equal eager's averaged
gradients under the whole-model tolerance rule, and each rank's report must count the sites a single-process
compile counts (under FSDP2 the layers' causal masks, made in an eager frame, are checked on the device and run
``is_causal``; with each layer compiled on its own, as
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
from sloth.runtime import proven_masks
from checkpointing import enable_checkpointing
from test_models import assert_model_close

pytest.importorskip("peft")
WORLD = 2
VOCAB = 96
LAYERS = 2


def tiny_lora_llama(arch: str = "llama") -> torch.nn.Module:
    """A two-layer Llama (or, with ``arch="qwen3"``, Qwen3: q/k norms) with peft LoRA on every linear; with
    ``arch="llama-full"`` the Llama without adapters, every weight trained (the lm_head's among them)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    arch, _, full = arch.partition("-")
    config = transformers.AutoConfig.for_model(
        arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    if full:
        return transformers.AutoModelForCausalLM.from_config(config)
    model = get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
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
# fsdp2-ckpt: FSDP2 over a model with gradient checkpointing (non-reentrant, each decoder layer); qwen3-fsdp2: FSDP2
# over a tiny Qwen3 (its q/k norms inside each sharded layer; under DDP, which does not shard, Qwen3 would add nothing
# to ddp's Llama but ~20 s of CPU to CI); *-inductor: Inductor, sloth's default, as the
# inner compiler (the others use aot_eager, to keep the test short); full-fsdp2: full fine-tuning, no adapters, so the
# fused loss's lm_head weight is a trained sharded parameter (the op sees it gathered; its gradient must reach the
# shard).
ENGINES = ("fsdp2", "fsdp2-per-layer", "ddp", "fsdp2-bf16", "fsdp2-bf16-eager", "fsdp2-ckpt", "qwen3-fsdp2",
           "fsdp2-inductor", "ddp-inductor", "full-fsdp2")


def _arch(engine: str) -> str:
    return "qwen3" if engine.startswith("qwen3-") else "llama-full" if engine.startswith("full-") else "llama"


def _worker(rank: int, port: int, out: str) -> None:
    """Both engines in turn in one pair of processes (a process start costs ~15 s of imports here)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for engine in ENGINES:
            torch._dynamo.reset()
            sloth.reset_report()
            proven_masks.reset()
            model = tiny_lora_llama(_arch(engine))
            if engine == "fsdp2-ckpt":
                enable_checkpointing(model, use_reentrant=False)
            options = {"inner": "inductor" if engine.endswith("-inductor") else "aot_eager"}
            if "fsdp2" in engine:
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                    if "bf16" in engine else MixedPrecisionPolicy()
                layers = (model if engine.startswith("full-") else model.base_model.model).model.layers
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
            results[engine] = {"mask_calls": dict(proven_masks.calls),"losses": losses, "grads": grads, "counts": dict(report.counts),
                               "graphs": report.graphs, "unexplained": report.unexplained,
                               "rejections": [(r.family, r.module, r.reason) for r in report.rejections]}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _single_process_counts(arch: str) -> dict[str, int]:
    """The sites a single-process compile of the same model replaces."""
    single = tiny_lora_llama(arch)
    sloth.reset_report()
    ids = batches()[0]
    torch.compile(single, backend="sloth", options={"inner": "aot_eager"})(input_ids=ids, labels=ids)
    return dict(sloth.report().counts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eager_average(dtype: torch.dtype, arch: str = "llama") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean loss and gradients over the ranks' batches, one process, eager, at ``dtype``."""
    model = tiny_lora_llama(arch).to(dtype)
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
    archs = ("llama", "qwen3", "llama-full")
    eager = {arch: _eager_average(torch.float32, arch) for arch in archs}
    reference = {arch: _eager_average(torch.float64, arch) for arch in archs}
    single_counts = {arch: _single_process_counts(arch) for arch in archs}
    bf16_eager = results["fsdp2-bf16-eager"]
    bf16_eager = (torch.stack(bf16_eager["losses"]).mean().float(), bf16_eager["grads"])
    for engine in (e for e in ENGINES if e != "fsdp2-bf16-eager"):
        result, arch = results[engine], _arch(engine)
        loss = torch.stack(result["losses"]).mean()
        assert set(result["grads"]) == set(eager[arch][1]), (engine, sorted(set(result["grads"]) ^ set(eager[arch][1])))
        if engine == "fsdp2-bf16":  # bf16 compute: against the same policy run eagerly, at bf16's precision
            assert all(g.dtype == torch.float32 for g in result["grads"].values())  # reduced and kept in fp32
            assert_model_close((loss.float(), result["grads"]), bf16_eager, reference[arch], torch.bfloat16)
        else:
            assert_model_close((loss, result["grads"]), eager[arch], reference[arch], torch.float32)
        expected = dict(single_counts[arch])
        if engine == "fsdp2-per-layer":
            # Outside the compiled layers: the final norm and the lm_head with its loss (eager), and the mask: built
            # eagerly, transformers hands SDPA no mask and is_causal (no site to find), and so its key / value heads
            # unrepeated (no gqa_attention site either).
            expected["rms_norm"] -= 1
            for family in ("cross_entropy", "causal_mask", "gqa_attention"):
                expected.pop(family)
            assert not result["rejections"], result["rejections"]
        elif "fsdp2" in engine:
            # Dynamo breaks the graph at each fully_shard module and compiles the layer's frame once per set of
            # guards: once per layer, or once for both (checkpointed layers): the report counts each compiled graph
            # once, so the layers' families count the layer graphs compiled (one GLU each).
            compiled_layers = result["counts"].get("glu", 0)
            assert compiled_layers in (1, LAYERS), (engine, result["counts"])
            expected = {f: c if f == "cross_entropy" else (c - 1) * compiled_layers // LAYERS + 1 if f == "rms_norm"
                        else c * compiled_layers // LAYERS for f, c in expected.items()}
            # Each layer's graph receives transformers' causal mask as an input, made from position ids an eager
            # frame computed, which no graph proves causal: its values are checked on the device once a step
            # (the mask_check option) and every layer call runs is_causal.
            assert result["mask_calls"]["masked"] == 0 and result["mask_calls"]["causal"] >= LAYERS, (
                engine, result["mask_calls"])
        assert result["counts"] == expected, (engine, result["counts"], expected, result["rejections"])
        assert not result["unexplained"], (engine, result["unexplained"])


_TRAINER_SCRIPT = """
import os, sys
import torch
import sloth  # before the Trainer: it adds "sloth" to accelerate's backend names
import transformers
sys.path.insert(0, {tests!r})
from test_distributed import VOCAB, tiny_lora_llama

ids = torch.randint(3, VOCAB, (8, 11), generator=torch.Generator().manual_seed(4))
data = [{{"input_ids": row, "labels": row}} for row in ids]
for backend in ("eager", "sloth"):
    sloth.reset_report()
    args = transformers.TrainingArguments(output_dir={out!r} + backend, per_device_train_batch_size=2, max_steps=2,
                                          report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0,
                                          logging_steps=1, **({{"torch_compile_backend": "sloth"}} if backend == "sloth" else {{}}))
    trainer = transformers.Trainer(model=tiny_lora_llama(), args=args, train_dataset=data)
    trainer.train()
    if int(os.environ["RANK"]) == 0:
        print("LOSSES", backend, [h["loss"] for h in trainer.state.log_history if "loss" in h])
        print("COUNTS", backend, sorted(sloth.report().counts.items()))
"""


def test_trainer_under_torchrun_ddp(tmp_path):
    """transformers' Trainer in two processes under ``torchrun`` (accelerate wraps the model in DDP, then
    compiles it with ``torch_compile_backend="sloth"``): each logged loss equals the same run's eagerly, and each
    rank's graphs have every site a single-process compile has. (accelerate's FSDP plugin does not run on the
    CPU: it applies FSDP only to accelerator processes and trains CPU ones with DDP; docs/training.md.)"""
    import ast
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_TRAINER_SCRIPT.format(tests=os.path.dirname(__file__), out=str(tmp_path / "out-")))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
                           "--master_port", str(_free_port()), str(script)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = {}
    for line in done.stdout.splitlines():
        kind, backend, value = line.split(" ", 2) if line.startswith(("LOSSES", "COUNTS")) else (None, None, None)
        if kind:
            found[kind, backend] = ast.literal_eval(value)
    eager, ours = found["LOSSES", "eager"], found["LOSSES", "sloth"]
    assert len(eager) == len(ours) == 2 and ours == pytest.approx(eager, rel=1e-5), (ours, eager)
    counts = dict(found["COUNTS", "sloth"])
    assert counts == _single_process_counts("llama"), counts


def _qlora_batches() -> torch.Tensor:
    return torch.randint(0, 128, (WORLD, 2, 9), generator=torch.Generator().manual_seed(2))


def _qlora_worker(rank: int, port: int, out: str) -> None:
    """A tiny peft QLoRA Llama (tests/test_qlora.py: bitsandbytes NF4 bases, their bytes stored as float32 so that
    FSDP2 shards them) under fully_shard per layer and on the root, compiled whole with sloth."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.fsdp import fully_shard
        from test_qlora import qlora_model

        model = qlora_model(torch.float32, storage=torch.float32)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})
        ids = _qlora_batches()[rank]
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        losses = [torch.zeros(()) for _ in range(WORLD)]
        dist.all_gather(losses, loss.detach())
        grads = _grads(model)
        report = sloth.report()
        if rank == 0:
            torch.save({"losses": losses, "grads": grads, "counts": dict(report.counts),
                        "rejections": [(r.family, r.module, r.reason) for r in report.rejections]}, out)
    finally:
        dist.destroy_process_group()


def test_qlora_under_fsdp2_on_two_ranks_matches_one_eager_process(tmp_path):
    # Unfused before (0 of 14 sites: bitsandbytes' quant-state recovery broke the graph at each 4-bit linear, and
    # its float-stored bytes were refused): compiler/integrations/bnb_quant_state.py, patterns/bnb_4bit.py.
    pytest.importorskip("bitsandbytes")
    from test_qlora import TARGETS, dense_fp64_copy, qlora_model

    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_qlora_worker, args=(_free_port(), out), nprocs=WORLD, start_method="spawn", join=True)
    result = torch.load(out)
    model = qlora_model(torch.float32, storage=torch.float32)
    averages = []
    for run in (model, dense_fp64_copy(model)):  # eager, and the fp64 reference with bitsandbytes' own weights
        total, losses = {}, []
        for ids in _qlora_batches():
            run.zero_grad(set_to_none=True)
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
            for name, p in run.named_parameters():
                if p.grad is not None:
                    total[_name(name)] = total.get(_name(name), 0) + p.grad.detach() / WORLD
        averages.append((torch.stack(losses).mean(), total))
    eager, reference = averages
    loss = torch.stack(result["losses"]).mean()
    assert set(result["grads"]) == set(eager[1]) and len(eager[1]) == 2 * len(TARGETS), sorted(result["grads"])
    assert_model_close((loss, result["grads"]), eager, reference, torch.float32)
    # The one layer's graph: each 4-bit linear with its adapter, one op per site.
    assert result["counts"].get("lora") == len(TARGETS), (result["counts"], result["rejections"])
