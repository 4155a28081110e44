"""Preference and RL training steps through TRL 1.16: a DPO step and a GRPO loss step of a random-weight Llama-3-8B
with LoRA, TRL as a user writes it (eager), under Inductor, and under sloth.

The workload (the GitHub issues' targets; e2e.py's model, seed 0, bf16, SDPA, LoRA r=16 alpha=16 dropout 0 on the
q/k/v/o/gate/up/down projections), TRL's defaults otherwise (bf16 autocast, non-reentrant gradient checkpointing,
learning rate 1e-6, the Trainer's default AdamW, gradient clipping at 1.0):

  dpo   ``DPOTrainer`` (sigmoid loss, beta 0.1) on a batch of 2 preference pairs, each sequence prompt + completion =
        1024 tokens (512 + 511 words and the EOS TRL appends): 2 x 2 x 1024 tokens. ``ref_model=None`` on a peft
        model: the reference is the policy with its adapters disabled, a no-grad forward in every step.
  grpo  ``GRPOTrainer``'s loss step on 8 completions of 1024 tokens for one 128-token prompt, beta 0.04 (GRPOConfig's
        default 0.0 drops the reference; 0.04 is DeepSeekMath's). Generation is out of scope:
        ``_generate_and_score_completions`` returns fixed random completions and group-normalised advantages, and
        the adapter-disabled reference's log-probabilities as TRL computes them (tests/test_trl_preference.py), so
        a step is the reference forward, the policy's forward and backward, the clip and the optimizer step.

Variants (``--variants``): ``trl-eager`` (``torch_compile=False``), ``trl-inductor`` (``torch_compile=True``,
``torch_compile_backend="inductor"``), ``sloth`` (``torch_compile_backend="sloth"``, no options: the headline) and
``sloth-no-head`` (sloth with ``SLOTH_TRL_HEAD=0``: TRL's own fused LM head, compiler/integrations/trl_head.py, so the
difference to ``sloth`` is what the head replacement buys). The Trainer compiles the model it passes to
``compute_loss``; TRL runs the reference forward through ``self.model``, the uncompiled module, so in every variant
that forward is eager (dpo_trainer.py ``_compute_loss``, grpo_trainer.py ``_generate_and_score_completions``; on the
CPU sloth's report holds one forward's sites, and Dynamo one graph).

Nothing in the libraries is changed: what each variant runs is what a user gets (sloth's own integrations, installed at
``import sloth``, included: compiler/integrations/). The record's ``timed recompiles`` shows whether any compile fell
in the timed steps (TRL turns checkpointing off and on around each reference forward; before sloth removed the
hooks that left behind, compiler/integrations/input_grads_hook.py, every sloth step recompiled).

Every (task, variant) runs ``trainer.train()`` for warm-up + timed steps in a process of its own (a fresh CUDA
allocator, Dynamo cache and peak counter). A callback synchronises and reads the clock at each step's begin and end
(the Trainer fetches and collates the batch before ``on_step_begin``; the step is ``training_step``, the clip, the
optimizer and scheduler steps). The first step's wall time is the warm-up (compile) seconds; peak GiB is
``torch.cuda.max_memory_allocated()`` over the timed steps, after ``reset_peak_memory_stats()``. The logged loss,
gradient norm and a forward statistic of every step are kept so that the variants can be compared: the first step's
policy is the reference (LoRA's B is zero), so DPO's first loss is ln 2 and GRPO's 0 (its advantages sum to zero over
equal-length completions) up to the rounding between a compiled policy and the eager reference; the first step's
gradient norm and log-probabilities (DPO) or entropy (GRPO) are the numbers that must agree to bf16 rounding.

MFU = model FLOPs per step / step time / the bf16 matmul rate (measured, or --peak-tflops). T tokens, L of them
scored by TRL's head (DPO: the completion tokens, GRPO: the completions'), H the head's parameters, recomputation
under checkpointing not counted: policy 4 (P_frozen - H) T + 4 H L + 6 P_trainable T + 6 b s^2 (heads x head_dim)
layers (e2e.py's formula, the head over L tokens only), plus the reference's forward 2 (P_frozen - H) T + 2 H L +
2 b s^2 (heads x head_dim) layers.

    python -m benchmarks.preference --task both                  # the GPU run: trl-eager, trl-inductor, sloth
    python -m benchmarks.preference --task dpo --variants trl-eager sloth --warmup 2 --steps 5
    python -m benchmarks.preference --task both --smoke --variants trl-eager sloth --warmup 1 --steps 2   # CPU

One line per run starts with ``[pref] <task> <variant>:``; a table and a record (common.write_result:
benchmarks/results and $OUT; ``--smoke`` writes none unless --results-dir is given) come at the end, or when the
run is terminated (SIGTERM), with the rows finished so far.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks import common, e2e

TASKS = ["dpo", "grpo"]
VARIANTS = ["trl-eager", "trl-inductor", "sloth", "sloth-no-head"]
DEFAULT_VARIANTS = VARIANTS[:3]
# Each variant as TrainingArguments and environment: (torch_compile_backend or None for no compile, extra env).
VARIANT_SETTINGS: dict[str, tuple[Optional[str], dict[str, str]]] = {
    "trl-eager": (None, {}),
    "trl-inductor": ("inductor", {}),
    "sloth": ("sloth", {}),
    "sloth-no-head": ("sloth", {"SLOTH_TRL_HEAD": "0"}),
}
COLUMNS = ["task", "variant", "step ms", "median ms", "x eager", "tok/s", "MFU %", "peak GiB", "warm-up s",
           "losses", "grad norms", "graphs", "timed recompiles", "sloth sites", "error"]
# The statistic of the forward each task logs that compares the variants' forwards on the first step (module docstring)
FORWARD_METRIC = {"dpo": "logps/chosen", "grpo": "entropy"}
KEPT_METRICS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins", "entropy", "kl")
SHOWN_STEPS = 4  # losses and gradient norms printed per run


# ----------------------------------------------------------------------------- the workload


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of ``vocab_size`` ids: four special tokens (0 pad, 1 BOS, 2 EOS, 3 unk), then the words
    ``w0`` ... (no BOS added; a random model needs no real text, TRL needs a tokenizer to prepare DPO's dataset)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(vocab_size - 4)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


def _words(g: torch.Generator, n: int, vocab_size: int) -> str:
    return " ".join(f"w{i}" for i in torch.randint(0, vocab_size - 4, (n,), generator=g).tolist())


def dpo_dataset(rows: int, prompt_len: int, seq: int, vocab_size: int) -> Any:
    """``rows`` preference pairs, each sequence ``seq`` tokens: a prompt of ``prompt_len`` words, completions of
    ``seq - prompt_len - 1`` words (TRL appends the EOS). TRL concatenates prompt and completion as strings, so each
    completion starts with a space."""
    import datasets

    g = torch.Generator().manual_seed(0)
    completion = seq - prompt_len - 1
    return datasets.Dataset.from_list([{"prompt": _words(g, prompt_len, vocab_size),
                                        "chosen": " " + _words(g, completion, vocab_size),
                                        "rejected": " " + _words(g, completion, vocab_size)} for _ in range(rows)])


def grpo_trainer_class() -> type:
    """GRPOTrainer whose generation returns fixed completions (tests/test_trl_preference.py's, at full length)."""
    import trl
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    class FixedCompletionsGRPOTrainer(trl.GRPOTrainer):
        """Per step: one prompt of ``prompt_len`` random tokens, ``num_generations`` completions of
        ``max_completion_length`` random tokens (no padding, so every step has one shape), advantages of random
        rewards normalised within the group, and the adapter-disabled reference's log-probabilities computed as
        grpo_trainer.py does (no grad, checkpointing off, batches of ``per_device_train_batch_size``)."""

        prompt_len = 128

        def _generate_and_score_completions(self, inputs):
            n, device = len(inputs), self.accelerator.device
            vocab = self.model.config.get_text_config().vocab_size
            g = torch.Generator().manual_seed(100 + self._step)
            prompt_ids = torch.randint(4, vocab, (1, self.prompt_len), generator=g).repeat(n, 1).to(device)
            completion_ids = torch.randint(4, vocab, (n, self.args.max_completion_length), generator=g).to(device)
            prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
            rewards = torch.rand(n, generator=g).view(-1, self.num_generations)
            advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
            output = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                      "completion_mask": completion_mask, "advantages": advantages.to(device),
                      "num_items_in_batch": completion_mask.sum()}
            if self.beta != 0.0:
                ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
                model = self.accelerator.unwrap_model(self.model)
                no_checkpointing = disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs)
                with torch.no_grad(), no_checkpointing, use_adapter(model, adapter_name=None):
                    output["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.model, ids, mask, completion_ids.size(1), batch_size=self.args.per_device_train_batch_size)
            return output

    return FixedCompletionsGRPOTrainer


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def step_clock(warmup: int, sync: Callable[[], None], cuda: bool) -> Any:
    """A TrainerCallback timing each optimizer step between on_step_begin and on_step_end, both synchronised; before
    the first timed step a full garbage collection (e2e.py says why) and the peak counter reset."""
    import transformers

    class StepClock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.walls: list[float] = []
            self.start = 0.0
            self.graphs_at_timed: Optional[int] = None
            self.peak_gib: Optional[float] = None
            self.reserved_gib: Optional[float] = None

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            if len(self.walls) == warmup:
                gc.collect()
                self.graphs_at_timed = _unique_graphs()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.walls.append(time.perf_counter() - self.start)
            # As it happens, so a run cut by its time limit shows how far it got (the parent prints the log's tail).
            print(f"step {len(self.walls)}: {self.walls[-1] * 1e3:.1f} ms, {_unique_graphs()} graphs", flush=True)
            if cuda and len(self.walls) > warmup:
                self.peak_gib = torch.cuda.max_memory_allocated() / common.GiB
                self.reserved_gib = torch.cuda.max_memory_reserved() / common.GiB

    return StepClock()


def step_flops(model: torch.nn.Module, cfg: Any, rows: int, seq: int, scored: int) -> dict[str, float]:
    """Model FLOPs of one step (module docstring): the policy's forward and backward and the reference's forward."""
    policy = e2e.step_flops(model, cfg, rows, seq)
    tokens, head = rows * seq, cfg.hidden_size * cfg.vocab_size
    body = policy["frozen_matmul_params"] - head
    policy_total = policy["total"] - 4 * head * (tokens - scored)
    reference = 2 * body * tokens + 2 * head * scored + policy["attention"] / 3
    return {"total": policy_total + reference, "policy": policy_total, "reference": reference,
            "scored_tokens": float(scored)}


# ----------------------------------------------------------------------------- one run


def _shapes(args: argparse.Namespace) -> dict[str, int]:
    """Rows and sequence length of the policy's batch, and the tokens TRL's head scores."""
    if args.task == "dpo":
        prompt = args.dpo_prompt or args.seq // 2
        return {"rows": 2 * args.pairs, "seq": args.seq, "prompt": prompt,
                "scored": 2 * args.pairs * (args.seq - prompt)}
    return {"rows": args.generations, "seq": args.grpo_prompt + args.grpo_completion, "prompt": args.grpo_prompt,
            "scored": args.generations * args.grpo_completion}


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model and the trainer for ``args.task``, train warm-up + timed steps, return the row."""
    common.use_triton_interpreter_without_cuda()  # before peft, trl or sloth import triton
    backend, _ = VARIANT_SETTINGS[args.variant]
    sloth = common.import_sloth() if backend == "sloth" else None  # before TrainingArguments: accelerate's name check
    import datasets
    import peft
    import trl

    datasets.disable_progress_bars()

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: use --smoke for the CPU toy run")
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shapes = _shapes(args)
    total_steps = args.warmup + args.steps

    setup_start = time.perf_counter()
    model, cfg = e2e.random_base_model(argparse.Namespace(model=args.model, layers=args.layers, seq=shapes["seq"]),
                                       device)
    tokenizer = word_tokenizer(cfg.vocab_size)
    lora = peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=e2e.MODELS[args.model][2],
                           task_type="CAUSAL_LM")
    clock = step_clock(args.warmup, sync, cuda)
    out_dir = tempfile.mkdtemp(prefix="sloth-pref-")
    trainer_args = dict(output_dir=out_dir, max_steps=total_steps, report_to=[], save_strategy="no", seed=0,
                        data_seed=0, logging_steps=1, disable_tqdm=True, dataloader_drop_last=True,
                        use_cpu=not cuda, gradient_checkpointing=not args.no_grad_ckpt,
                        torch_compile=backend is not None, torch_compile_backend=backend)
    if args.task == "dpo":
        config = trl.DPOConfig(per_device_train_batch_size=args.pairs, max_length=shapes["seq"], **trainer_args)
        data = dpo_dataset(args.pairs * total_steps, shapes["prompt"], shapes["seq"], cfg.vocab_size)
        trainer = trl.DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                                 peft_config=lora, callbacks=[clock])
        first = trainer.train_dataset[0]
        lengths = {len(first["prompt_ids"]) + len(first[k]) for k in ("chosen_ids", "rejected_ids")}
        if lengths != {shapes["seq"]}:
            raise RuntimeError(f"the tokenized pair has {sorted(lengths)} tokens, not {shapes['seq']}")
    else:
        config = trl.GRPOConfig(per_device_train_batch_size=args.generations, num_generations=args.generations,
                                max_completion_length=args.grpo_completion, beta=args.grpo_beta, **trainer_args)
        trainer_cls = grpo_trainer_class()
        trainer_cls.prompt_len = shapes["prompt"]
        data = datasets.Dataset.from_list([{"prompt": f"w{i}"} for i in range(2 * total_steps)])
        trainer = trainer_cls(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                              reward_funcs=lambda completions, **kw: [0.0] * len(completions), peft_config=lora,
                              callbacks=[clock])
    if trainer.ref_model is not None:
        raise RuntimeError("TRL built a reference model; the benchmark means the adapter-disabled policy")
    flops = step_flops(trainer.model, cfg, shapes["rows"], shapes["seq"], shapes["scored"])
    setup_s = time.perf_counter() - setup_start
    print(f"set up in {setup_s:.1f} s; training", flush=True)

    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)  # save_strategy "no": the Trainer's output_dir is left empty

    walls_ms = [w * 1e3 for w in clock.walls]
    timed = walls_ms[args.warmup:]
    if len(timed) != args.steps:
        raise RuntimeError(f"{len(walls_ms)} steps ran, not {total_steps}")
    step_ms = statistics.fmean(timed)
    logged = [{k: h[k] for k in KEPT_METRICS if k in h} for h in trainer.state.log_history if "loss" in h]
    peak_tflops = args.peak_tflops or common.matmul_tflops()
    report = sloth.report() if sloth is not None else None
    counts = dict(report.counts) if report is not None else None
    dynamo = torch._dynamo.utils.counters
    compiled = backend is not None
    return {
        "task": args.task,
        "variant": args.variant,
        "step ms": step_ms,
        "median ms": statistics.median(timed),
        "tok/s": shapes["rows"] * shapes["seq"] / (step_ms * 1e-3),
        "MFU %": 100 * flops["total"] / (step_ms * 1e-3) / (peak_tflops * 1e12),
        "peak GiB": clock.peak_gib,
        "reserved GiB": clock.reserved_gib,
        "warm-up s": walls_ms[0] / 1e3 if args.warmup else None,
        "setup s": setup_s,
        "steps ms": walls_ms,
        "logged": logged,
        "losses": " ".join(f"{h['loss']:.5g}" for h in logged[:SHOWN_STEPS]),
        "grad norms": " ".join(f"{h.get('grad_norm', math.nan):.4g}" for h in logged[:SHOWN_STEPS]),
        "graphs": _unique_graphs() if compiled else None,
        "timed recompiles": _unique_graphs() - clock.graphs_at_timed if compiled and clock.graphs_at_timed is not None
        else None,
        "graph breaks": sum(dynamo["graph_break"].values()) if compiled else None,
        "sloth sites": sum(counts.values()) if counts is not None else None,
        "sloth counts": counts,
        "sloth head sites": (sum(1 for s in report.sites if s.family == "token_logprobs" and "TRL" in s.detail)
                             if report is not None else None),
        "sloth failed": dict(report.failed) if report is not None and report.failed else None,
        "sloth report": str(report) if report is not None else None,
        "sloth env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLOTH_")},
        "shapes": shapes,
        "trainer": {k: getattr(trainer.args, k) for k in ("learning_rate", "bf16", "gradient_checkpointing",
                                                          "gradient_checkpointing_kwargs", "max_grad_norm", "beta")}
        | {"optim": str(trainer.args.optim), "loss_type": str(getattr(trainer.args, "loss_type", None))},
        "flops": flops,
        "peak_tflops": peak_tflops,
    }


# ----------------------------------------------------------------------------- driver


def _child_command(args: argparse.Namespace, task: str, variant: str, json_out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.preference", "--child", "--task", task, "--variants", variant,
           "--json-out", str(json_out), "--model", args.model, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--pairs", str(args.pairs), "--seq", str(args.seq), "--dpo-prompt", str(args.dpo_prompt),
           "--generations", str(args.generations), "--grpo-prompt", str(args.grpo_prompt),
           "--grpo-completion", str(args.grpo_completion), "--grpo-beta", str(args.grpo_beta),
           "--layers", str(args.layers), "--peak-tflops", str(args.peak_tflops)]
    return cmd + ["--no-grad-ckpt"] * args.no_grad_ckpt + ["--smoke"] * args.smoke


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _summary(row: dict[str, Any], wall: float) -> str:
    """The run's line (``[pref] <task> <variant>: <mean ms> ms ...``) and, indented, each step's ms."""
    line = (f"[pref] {row['task']} {row['variant']}: {_fmt(row['step ms'], '.1f')} ms mean, "
            f"{_fmt(row['median ms'], '.1f')} ms median, {_fmt(row['tok/s'], '.0f')} tok/s, "
            f"MFU {_fmt(row['MFU %'], '.1f')}%, peak {_fmt(row['peak GiB'], '.1f')} GiB, "
            f"warm-up {_fmt(row['warm-up s'], '.1f')} s, setup {_fmt(row['setup s'], '.1f')} s; "
            f"losses {row['losses']}; grad norms {row['grad norms']}")
    if row["graphs"] is not None:
        line += (f"; graphs {row['graphs']} (+{row['timed recompiles']} in the timed steps), "
                 f"breaks {row['graph breaks']}")
    if row["sloth counts"] is not None:
        line += f"; sloth sites {row['sloth sites']} {row['sloth counts']}"
        if row.get("sloth failed"):
            line += f", failed {row['sloth failed']}"
    steps = " ".join(f"{t:.1f}" for t in row["steps ms"])
    return f"{line} ({wall:.0f} s)\n    {row['task']} {row['variant']} steps ms (warm-up first): {steps}"


def _against_eager(rows: list[dict[str, Any]], task: str) -> None:
    """Each row's ``vs eager``: the largest difference from trl-eager's logged numbers over the steps both ran, for
    the loss (absolute), the gradient norm and the task's forward statistic (relative); printed per run."""
    eager = next((r for r in rows if r["task"] == task and r["variant"] == "trl-eager" and "logged" in r), None)
    if eager is None:
        return
    for row in rows:
        if row["task"] != task or "logged" not in row:
            continue
        row["x eager"] = eager["step ms"] / row["step ms"]
        if row is eager:
            continue
        pairs = list(zip(eager["logged"], row["logged"]))
        diff = {"loss abs": max((abs(e["loss"] - s["loss"]) for e, s in pairs), default=None)}
        for key in ("grad_norm", FORWARD_METRIC[task]):
            rel = [abs(e[key] - s[key]) / max(abs(e[key]), 1e-12) for e, s in pairs if key in e and key in s]
            diff[f"{key} rel"] = max(rel, default=None)
        row["vs eager"] = diff
        print(f"    {task} {row['variant']} vs trl-eager over {len(pairs)} steps: "
              + ", ".join(f"{k} {_fmt(v, '.3g')}" for k, v in diff.items()), flush=True)


def run_all(args: argparse.Namespace) -> int:
    """Each (task, variant) in its own process; a summary line each; the table and the record at the end."""
    tasks = TASKS if args.task == "both" else [args.task]
    if not args.peak_tflops:
        # measured once, here, so every row shares one denominator (e2e.py does the same)
        args.peak_tflops = common.matmul_tflops()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"bf16 matmul peak (measured): {args.peak_tflops:.3g} TFLOP/s", flush=True)
    rows: list[dict[str, Any]] = []
    # a terminated run (the suites' step limit sends SIGTERM to the group) still writes the rows it has
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for task in tasks:
                for variant in args.variants:
                    rows.append(_run_child(args, task, variant, Path(tmp)))
                _against_eager(rows, task)
    finally:
        _finish(args, tasks, rows)
    return 1 if any("error" in r for r in rows) else 0


def _run_child(args: argparse.Namespace, task: str, variant: str, tmp: Path) -> dict[str, Any]:
    json_out, log = tmp / f"{task}-{variant}.json", tmp / f"{task}-{variant}.log"
    # Recompiles logged with their reasons: a compile in a timed step is a finding, and one cut by the time limit too.
    env = {"TORCH_LOGS": "recompiles", **os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **VARIANT_SETTINGS[variant][1]}
    print(f"[pref] {task} {variant}: running ...", flush=True)
    start = time.perf_counter()
    rc: int | str
    with log.open("w") as fh:
        try:
            rc = subprocess.run(_child_command(args, task, variant, json_out), stdout=fh, stderr=subprocess.STDOUT,
                                env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    if rc == 0 and json_out.exists():
        row = json.loads(json_out.read_text())
        print(_summary(row, wall), flush=True)
        return row
    tail = log.read_text(errors="replace").splitlines()[-25:]
    error = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), f"exit {rc}")
    print(f"[pref] {task} {variant}: FAILED ({rc}, {wall:.0f} s): {error.strip()[:200]}; last lines:", flush=True)
    print("\n".join("    " + ln for ln in tail), flush=True)
    return {"task": task, "variant": variant, "error": error.strip()[:200], "log tail": tail}


def _finish(args: argparse.Namespace, tasks: list[str], rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print()
    print(common.render_text(COLUMNS, rows), flush=True)
    if args.smoke and not args.results_dir:
        return
    config = {k: v for k, v in vars(args).items() if k not in ("child", "json_out", "results_dir")}
    config["flops_formula"] = ("policy 4 (P_frozen - H) T + 4 H L + 6 P_trainable T + 6 b s^2 (heads x head_dim) "
                               "layers; reference 2 (P_frozen - H) T + 2 H L + 2 b s^2 (heads x head_dim) layers")
    record = common.result_record("preference", config, COLUMNS, rows)
    suffix = f"-{'-'.join(tasks)}-{args.model}" + (f"-L{args.layers}" if args.layers else "") + (
        "-nockpt" if args.no_grad_ckpt else "") + ("-smoke" if args.smoke else "")
    for path in common.write_result(record, args.results_dir, suffix):
        print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=[*TASKS, "both"], default="both")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                        help=f"of {', '.join(VARIANTS)}, space or comma separated (default: "
                             f"{' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--model", choices=list(e2e.MODELS), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=0, help="shrink the model to N decoder layers")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=2, help="DPO: preference pairs per step")
    parser.add_argument("--seq", type=int, default=1024, help="DPO: tokens of each prompt + completion")
    parser.add_argument("--dpo-prompt", type=int, default=0, help="DPO: prompt tokens (0: half of --seq)")
    parser.add_argument("--generations", type=int, default=8, help="GRPO: completions of the one prompt per step")
    parser.add_argument("--grpo-prompt", type=int, default=128, help="GRPO: prompt tokens")
    parser.add_argument("--grpo-completion", type=int, default=1024, help="GRPO: tokens of each completion")
    parser.add_argument("--grpo-beta", type=float, default=0.04, help="GRPO: KL coefficient (0: no reference)")
    parser.add_argument("--no-grad-ckpt", action="store_true", help="turn off TRL's default gradient checkpointing")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="MFU denominator; measured if 0")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU toy: e2e's tiny Llama (hidden 64, 2 layers, vocab 256), DPO 2 x 2 x 32 tokens, "
                             "GRPO 8 x (8 + 8)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per (task, variant) process")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (smoke: none)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.variants = [v for item in args.variants for v in item.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if args.smoke:
        args.model = e2e.SMOKE_MODEL.get(args.model, args.model)
        # 128 tokens a policy forward for either task: sloth's kernels run in Triton's interpreter on the CPU, whose
        # cost grows with the programs launched (2 cores: a sloth DPO step 28 s at 2 x 2 x 64 tokens, 12-17 s at 32)
        args.seq, args.dpo_prompt, args.grpo_prompt, args.grpo_completion = 32, 16, 8, 8
    if not args.child:
        return run_all(args)
    if args.task == "both" or len(args.variants) != 1:
        parser.error("--child runs one task and one variant")
    args.variant = args.variants[0]
    row = run_one(args)
    if args.json_out:
        args.json_out.write_text(json.dumps(row, default=str))
    print(json.dumps({k: row[k] for k in COLUMNS if k in row}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
