"""Coverage over transformers: every decoder-only causal LM, one training step eagerly and through sloth.

    python -m benchmarks.coverage                       # every model type, writes docs/coverage.md and a JSON
    python -m benchmarks.coverage llama qwen3 gpt2      # some of them
    python -m benchmarks.coverage --one llama           # one, in this process (what each subprocess runs)

For each model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (each in its own subprocess, with a
time limit): a tiny config with random weights (``tiny_config``: widths shrunk, at most four layers, the
first of each kind a ``layer_types`` list names), fp32 on the CPU, in eval mode (dropout off, so the three
runs compute one function; gradients flow as in training); one forward and backward of
``model(input_ids, labels)`` eagerly, in float64, and through ``torch.compile(backend="sloth",
options={"inner": "aot_eager"})`` with sloth's ops on their CPU references (no Triton interpreter: the kernels
have their own tests; this measures the graph side). The row says, per family, the sites replaced, the anchors
left in the graphs and the reasons given for them (compiler/anchors.py: a site neither replaced nor explained
is "unexplained"), the graphs and graph breaks, and whether loss and gradients meet the whole-model tolerance
rule of tests/test_models.py (``assert_model_close``) against eager and float64.

A model that fails to build from the shrunk config, or fails eagerly, is listed with the error: those are the
shrinking's or transformers' limits, not sloth's, and are outside the denominator of "trains". A model that
fails under sloth is compiled again with plain ``torch.compile(backend="aot_eager")``; when that fails too, the
step is run again through sloth with its default inner compiler, Inductor (the row's "inner"), and if that
fails as well the row says "torch error".
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128
SEQ = 9
# Config fields shrunk wherever a config has them (names differ between families; each is set only if present).
_SHRINK = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "model_dim": 64,
    "intermediate_size": 96, "n_inner": 96, "ffn_dim": 96, "ffn_hidden_size": 96, "mlp_dim": 96,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "q_lora_rank": 32, "kv_lora_rank": 16,
    "moe_intermediate_size": 32, "expert_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k": 2, "n_group": 1,
    "topk_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "sliding_window": 4, "attention_chunk_size": 4, "first_k_dense_replace": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "ssm_state_size": 8,
    "conv_kernel": 4, "mamba_d_conv": 4, "num_hidden_layers_per_block": 1,
}
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
MAX_LAYERS = 4


def decoder_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def set_field(target: Any, name: str, value: Any) -> None:
    try:
        setattr(target, name, value)
    except AttributeError:  # a property derived from other fields (no setter): it follows them
        pass


def tiny_config(model_type: str) -> Any:
    """The model type's default config with its widths shrunk and at most MAX_LAYERS layers (keeping the
    first layer of each kind a ``layer_types`` list names, in order)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    text = getattr(cfg, "text_config", None) or cfg
    for target in {id(cfg): cfg, id(text): text}.values():
        for name, value in _SHRINK.items():
            if isinstance(getattr(target, name, None), int) and not isinstance(getattr(target, name), bool):
                set_field(target, name, value)
        # Multi-latent attention rotates a qk_rope_head_dim part of each head, and its rotary embedding reads
        # head_dim (deepseek_v3 sets head_dim = qk_rope_head_dim): keep the two equal.
        if isinstance(getattr(target, "qk_rope_head_dim", None), int) and hasattr(target, "head_dim"):
            set_field(target, "head_dim", target.qk_rope_head_dim)
            if isinstance(getattr(target, "num_key_value_heads", None), int):  # MLA expands k and v to every head
                set_field(target, "num_key_value_heads", target.num_attention_heads)
        layer_types = getattr(target, "layer_types", None)
        if isinstance(layer_types, (list, tuple)) and layer_types:
            kinds = list(dict.fromkeys(layer_types))[:MAX_LAYERS]
            kept = [layer_types[layer_types.index(kind)] for kind in kinds]
            kept = (kept * 2)[:max(2, len(kept))]  # two layers at least, so a layer's output feeds a layer
            set_field(target, "layer_types", kept)
            layers = len(kept)
        else:
            layers = 2
        for name in _LAYERS:
            if isinstance(getattr(target, name, None), int):
                set_field(target, name, layers)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(target, name, None) is not None and not isinstance(getattr(target, name), (list, tuple)):
                set_field(target, name, min(int(getattr(target, name)), VOCAB - 1))
    return cfg


def run_one(model_type: str, overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One model type's row (see the module docstring); never raises: errors go into the row. ``overrides``
    sets more config fields after the shrinking (on the text config too), e.g. a grouped router's n_group."""
    import torch
    from transformers import AutoModelForCausalLM

    setup()
    try:
        torch.manual_seed(0)
        cfg = tiny_config(model_type)
        for target in {id(cfg): cfg, id(getattr(cfg, "text_config", None) or cfg): getattr(cfg, "text_config", None)
                       or cfg}.values():
            for name, value in (overrides or {}).items():
                set_field(target, name, value)
        model = from_config(AutoModelForCausalLM, cfg)
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    except Exception as error:  # the row records it; the sweep goes on
        return error_row(model_type, "build error", error)
    return step_row(model_type, model, {"input_ids": ids, "labels": ids})


def setup() -> Any:
    """sloth imported (its backend registered) and tests/ on the path (the tolerance rule); returns sloth."""
    from benchmarks import common

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    return common.import_sloth()


def from_config(auto_class: Any, cfg: Any) -> Any:
    """A random-weight model of ``cfg`` in fp32 and eval mode, with random norm weights and no all-zero matrices."""
    import torch

    try:
        model = auto_class.from_config(cfg, attn_implementation="sdpa")
    except (ValueError, TypeError):  # no SDPA path: eager attention is the same math
        model = auto_class.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()  # no dropout draws: eager, float64 and sloth must see one function
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random, not unit, norm weights: an ignored weight would pass unnoticed
                p.normal_(0.0, 0.5)
            elif p.dim() >= 2 and not name.endswith("bias") and not p.any():
                # A weight matrix initialised to zeros (AFMoE's router) makes every score tie, and which
                # of equal experts a top-k takes is the implementation's choice (torch.topk's differs
                # between CPU and CUDA; sloth's router ops take the lower index): random, as a trained one.
                p.normal_(0.0, 0.02)
    return model


def error_row(model_type: str, status: str, error: BaseException) -> dict[str, Any]:
    """The row of a model type that stopped at ``status`` with ``error``."""
    inner = getattr(error, "inner_exception", None) or error  # Dynamo wraps the backend's own error
    return {"model": model_type, "status": status, "commit": common_commit(),
            "error": f"{type(inner).__name__}: {str(inner).splitlines()[0][:300] if str(inner) else ''}",
            "traceback": "".join(traceback.format_exception(inner))[-3000:]}


def loss_and_grads(model: Any, inputs: dict[str, Any], run: Any = None) -> tuple[Any, dict[str, Any]]:
    """tests/test_models.py's loss_and_grads with the step's keyword arguments (``labels`` among them) given whole;
    floating tensors among them (pixel values) cast to the model's dtype, so the float64 copy sees float64 inputs."""
    import torch

    dtype = next(model.parameters()).dtype
    inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def step_row(model_type: str, model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The row of one training step of ``model`` on ``inputs`` (keyword arguments, ``labels`` among them): eagerly
    in float64 (a copy) and fp32, then through sloth; never raises: errors go into the row."""
    import torch

    import sloth
    from test_models import assert_model_close  # setup() put tests/ on the path

    row: dict[str, Any] = {"model": model_type, "status": "ok", "commit": common_commit()}
    stage = "eager"
    try:
        reference = copy.deepcopy(model).double()
        for module in reference.modules():  # grouped_mm experts take no float64: the per-expert loop, same math
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "_experts_implementation", None) not in (None, "eager"):
                config._experts_implementation = "eager"
        ref = loss_and_grads(reference, inputs)
        eager = loss_and_grads(model, inputs)
        if not torch.isfinite(eager[0]):
            raise RuntimeError(f"eager loss is {eager[0].item()}")
        stage = "sloth"
        try:
            ours, report, row["compile+step s"] = _through_sloth(model, inputs, "aot_eager")
        except Exception as error:
            if not _fails_without_sloth(model, inputs):
                raise
            # aot_eager runs the backward graph's ops eagerly at the strides the trace predicted, and where plain
            # torch.compile(backend="aot_eager") fails too (seen: softplus_backward's output viewed in Qwen3.5's
            # gated delta rule), sloth's default inner compiler, Inductor, is what a user gets: run that instead.
            inner = getattr(error, "inner_exception", None) or error
            first_line = str(inner).splitlines()[0][:200] if str(inner) else ""
            row["aot_eager error"] = f"{type(inner).__name__}: {first_line}"
            ours, report, row["compile+step s"] = _through_sloth(model, inputs, "inductor")
            row["inner"] = "inductor"
        families: dict[str, dict[str, Any]] = {}
        for family in sloth.FAMILIES:
            reasons = sorted({r.reason for r in report.rejections if r.family == family})
            families[family] = {"replaced": report.counts.get(family, 0), "left": report.anchors_left.get(family, 0),
                                "unexplained": len(report.unexplained.get(family, [])), "reasons": reasons}
        row["families"] = families
        counters = torch._dynamo.utils.counters
        row["graphs"] = report.graphs
        row["graph breaks"] = sum(counters["graph_break"].values())
        row["break reasons"] = sorted(str(k)[:160] for k in counters["graph_break"])[:3]
        stage = "parity"
        try:
            # A parameter whose every path to the loss is empty (deepseek_v4's compressor at 9 tokens) has no
            # gradient eagerly and a zero one from a compiled graph (as plain torch.compile gives it): the same value.
            extra = set(ours[1]) - set(eager[1])
            if extra and all(not ours[1][n].any() for n in extra):
                row["zero grads where eager has none"] = len(extra)
                ours = (ours[0], {n: g for n, g in ours[1].items() if n not in extra})
            assert ours[1].keys() == eager[1].keys(), "sloth's gradients are for other parameters than eager's"
            assert_model_close(ours, eager, ref, torch.float32)
            row["parity"] = "pass"
        except AssertionError as error:
            row["parity"] = "fail: " + str(error).splitlines()[0][:300]
    except Exception as error:  # the row records it; the sweep goes on
        row["status"] = f"{stage} error"
        if stage == "sloth" and _fails_without_sloth(model, inputs):
            row["status"] = "torch error"  # plain torch.compile(backend="aot_eager") fails too: not sloth's
        inner = getattr(error, "inner_exception", None) or error  # Dynamo wraps the backend's own error
        row["error"] = f"{type(inner).__name__}: {str(inner).splitlines()[0][:300] if str(inner) else ''}"
        row["traceback"] = "".join(traceback.format_exception(inner))[-3000:]
    return row


def _through_sloth(model: Any, inputs: dict[str, Any], inner: str) -> tuple[Any, Any, float]:
    """(loss and gradients, sloth's report, seconds) of one step through ``torch.compile(backend="sloth")``."""
    import torch

    import sloth

    torch._dynamo.reset()
    sloth.reset_report()
    start = time.perf_counter()
    ours = loss_and_grads(model, inputs, run=torch.compile(model, backend="sloth", options={"inner": inner}))
    return ours, sloth.report(), round(time.perf_counter() - start, 2)


def _fails_without_sloth(model: Any, inputs: dict[str, Any]) -> bool:
    import torch

    torch._dynamo.reset()
    try:
        loss_and_grads(model, inputs, run=torch.compile(model, backend="aot_eager"))
        return False
    except Exception:
        return True


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One coverage sweep: what it runs over and the table it writes (this module's over causal LMs;
    benchmarks/coverage_vlm.py's over image-text-to-text models runs the same machinery)."""
    module: str  # run with ``--one MODEL_TYPE`` in each subprocess
    model_types: Callable[[], list[str]]
    run_one: Callable[[str], dict[str, Any]]
    out: Path  # the table; its rows beside it, with the suffix .json
    title: str  # the table's first line
    step: str  # what one row measures, for the header
    noun: str  # what a row is, for the summary line
    columns: tuple[str, ...]  # families with a column of their own
    footnote: str = ""
    lora_column: bool = True  # a column of LoRA sites replaced, marked * (footnote), after the families'
    statuses: bool = False  # the summary counts the rows of each status too


def sweep(model_types: list[str], timeout: float, jobs: int, done: Any = None,
          module: str = "benchmarks.coverage") -> list[dict[str, Any]]:
    """Each model type in its own subprocess (``python -m MODULE --one MODEL_TYPE``), ``jobs`` at a time, each within
    ``timeout`` seconds; ``done(rows)`` after each one finishes (the rows so far, in ``model_types`` order), so an
    interrupted sweep leaves a table."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    pending, running, rows = list(model_types), [], {}
    tmp = Path(tempfile.mkdtemp(prefix="sloth-coverage-"))
    while pending or running:
        while pending and len(running) < jobs:
            model_type = pending.pop(0)
            out = tmp / f"{model_type}.json"
            proc = subprocess.Popen([sys.executable, "-m", module, "--one", model_type,
                                     "--json-out", str(out)], cwd=REPO_ROOT, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            running.append((model_type, proc, out, time.monotonic()))
        time.sleep(0.2)
        for entry in list(running):
            model_type, proc, out, started = entry
            if proc.poll() is None and time.monotonic() - started < timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                rows[model_type] = {"model": model_type, "status": "timeout", "error": f"over {timeout:.0f} s"}
            elif out.exists():
                rows[model_type] = json.loads(out.read_text())
            else:
                rows[model_type] = {"model": model_type, "status": "crash", "error": f"exit code {proc.returncode}"}
            running.remove(entry)
            row = rows[model_type]
            print(f"{model_type:<28} {row['status']:<12} {row.get('parity', row.get('error', ''))[:90]}", flush=True)
            if done is not None:
                done([rows[m] for m in model_types if m in rows])
    return [rows[m] for m in model_types]


FAMILY_COLUMNS = ("layer_norm", "rms_norm", "l2_norm", "rope", "moe_route", "moe_router", "glu", "cross_entropy",
                  "causal_mask")
_NO_SITES = {"replaced": 0, "left": 0, "unexplained": []}  # a family a row's sloth did not have
LORA_FOOTNOTE = "*lora: no adapters in these models (plain fine-tuning); the peft LoRA models are in tests/test_models.py."


def complete(row: dict[str, Any]) -> bool:
    """Every site of every family replaced or reported with a reason, and parity with eager."""
    families = row.get("families", {})
    return (row.get("status") == "ok" and row.get("parity") == "pass"
            and not any(f["unexplained"] for f in families.values()))


def markdown(rows: list[dict[str, Any]], header: str, noun: str = "causal-LM model types",
             columns: tuple[str, ...] = FAMILY_COLUMNS, footnote: str = LORA_FOOTNOTE, lora_column: bool = True,
             statuses: bool = False) -> str:
    trained = [r for r in rows if r.get("status") in ("ok", "sloth error", "torch error", "timeout", "crash")]
    counts = ""
    if statuses:
        by_status = collections.Counter(r["status"] for r in rows)
        counts = " Rows by status: " + ", ".join(f"{status} {n}" for status, n in by_status.most_common()) + "."
    lora = " lora* |" if lora_column else ""
    lines = [header, "",
             f"{len(rows)} {noun}; {sum(r['status'] == 'ok' for r in rows)} compiled and stepped through "
             f"sloth; {sum(r.get('parity') == 'pass' for r in rows)} with loss and gradients within the tolerance rule; "
             f"{sum(complete(r) for r in rows)} of {len(trained)} that train eagerly with every site replaced or "
             "reported and parity (the bar). Cells: replaced / anchors left with a reason (! = left without one)."
             + counts, "",
             "| model | status | " + " | ".join(columns) + f" |{lora} graphs (breaks) | parity | reasons left |",
             "|---|---|" + "---|" * len(columns) + "---|" * lora_column + "---|---|---|"]
    for r in rows:
        families = r.get("families")
        if not families:
            lines.append(f"| {r['model']} | {r['status']} | " + " | ".join("" for _ in columns)
                         + " |" * lora_column + f" | | | {r.get('error', '')[:140].replace('|', '/')} |")
            continue
        cells = []
        for f in columns:
            c = families.get(f, _NO_SITES)
            cells.append(f"{c['replaced']} / {c['left']}" + ("!" if c["unexplained"] else "") if c["replaced"] or c["left"] else "")
        reasons = "; ".join(f"{f}: {reason}" for f, c in families.items() for reason in c["reasons"])
        parity = r.get("parity", "")
        status = r["status"] + (f" (inner {r['inner']})" if r.get("inner") else "")
        lines.append(f"| {r['model']} | {status} | " + " | ".join(cells) + " | "
                     + f"{families['lora']['replaced']} | " * lora_column
                     + f"{r['graphs']} ({r['graph breaks']}) | {parity[:80].replace('|', '/')} | "
                     f"{reasons[:300].replace('|', '/')} |")
    lines += ["", footnote] if footnote else []
    return "\n".join(lines) + "\n"


def main(plan: Optional[Sweep] = None) -> None:
    plan = plan or COVERAGE
    module = sys.modules[plan.run_one.__module__]
    parser = argparse.ArgumentParser(description=(module.__doc__ or "").split("\n")[0])
    parser.add_argument("models", nargs="*", help=f"model types (default: every one of the {plan.noun})")
    parser.add_argument("--one", help="run one model type in this process")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    parser.add_argument("--out", type=Path, default=plan.out)
    parser.add_argument("--merge", action="store_true",
                        help="keep the existing table's rows (its .json) for model types not run now; without model "
                             "types, run only those it has no row for (resume an interrupted sweep)")
    args = parser.parse_args()
    if args.one:
        row = plan.run_one(args.one)
        text = json.dumps(row)
        if args.json_out:
            args.json_out.write_text(text)
        print(text)
        return
    import torch
    import transformers

    model_types = args.models or plan.model_types()
    previous_path = args.out.with_suffix(".json")
    previous = json.loads(previous_path.read_text()) if args.merge and previous_path.exists() else []
    if args.merge and not args.models:  # resume: the model types the table has no row for yet
        model_types = [m for m in model_types if m not in {r["model"] for r in previous}]
    header = (f"{plan.title}\n\nGenerated by `python -m {plan.module}` "
              f"({time.strftime('%Y-%m-%d')}, CPU, torch {torch.__version__}, transformers {transformers.__version__}, "
              f"commit {common_commit()}): {plan.step}, eager vs sloth "
              "(inner aot_eager, CPU references; Inductor, sloth's default, where plain aot_eager fails too: the "
              "rows marked so), tolerance rule of tests/test_models.py.")
    everything = plan.model_types()

    def write(rows: list[dict[str, Any]]) -> None:
        fresh = {r["model"]: r for r in rows}
        merged = {r["model"]: r for r in previous}
        merged.update(fresh)
        ordered = [merged[m] for m in everything if m in merged] + [r for m, r in merged.items() if m not in everything]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        missing = len([m for m in everything if m not in merged])
        note = f"\n\n**Partial: {missing} of {len(everything)} model types not run yet.**" if missing else ""
        commits = sorted({r.get("commit", "before d9abdef") for r in ordered})
        if len(commits) > 1:
            note += f" Rows come from commits {', '.join(commits)} (each row's `commit` in the .json)."
        args.out.write_text(markdown(ordered, header + note, plan.noun, plan.columns, plan.footnote, plan.lora_column,
                                     plan.statuses))
        previous_path.write_text(json.dumps(ordered, indent=1))

    write(sweep(model_types, args.timeout, args.jobs, done=write, module=plan.module))
    print(f"wrote {args.out}", flush=True)


def common_commit() -> str:
    from benchmarks import common

    return common._run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"


COVERAGE = Sweep("benchmarks.coverage", decoder_model_types, run_one, REPO_ROOT / "docs" / "coverage.md",
                 "# sloth over transformers' causal LMs", "one fp32 training step of a tiny random model per type",
                 "causal-LM model types", FAMILY_COLUMNS, LORA_FOOTNOTE)


if __name__ == "__main__":
    main()
