"""TRL's trainers on a model sloth compiles: ``SFTTrainer`` (rows padded to varying lengths, packed, and
prompt-completion data with ``completion_only_loss``) and ``DPOTrainer``, tiny Qwen3 with peft LoRA on every
linear, ``torch_compile=True, torch_compile_backend="sloth"`` as a user writes it, against the same run eagerly.

Each logged step's loss, gradient norm and TRL's own metrics (entropy, token accuracy; DPO's rewards and
log-probabilities) must equal eager's, and the report must be reachable and list the families sloth replaced.
TRL 1.16 computes the loss in its own fused LM head (``trl.trainer.utils.add_fused_lm_head``: the model is
called with ``fused_lm_head=True`` and returns per-token log-probabilities), so no ``cross_entropy`` site exists
for sloth in these graphs; under sloth TRL's head is sloth's ``linear_token_logprobs``, traced into the model's
graph (compiler/integrations/trl_head.py; why: docs/training.md, "TRL"). The tokenizer is a word-level one built
here (no model hub).
"""
from __future__ import annotations

import pytest
import torch

import sloth
from test_models import build

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

WORDS = [f"w{i}" for i in range(90)]  # ids 4..93 of the tiny models' 96
METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")
DPO_METRICS = METRICS + ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def word_tokenizer(words: list[str] = WORDS) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of ``words`` (ids from 4) and four special tokens (0-3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


def _text(g: torch.Generator, n: int, words: list[str] = WORDS) -> str:
    return " ".join(words[i] for i in torch.randint(0, len(words), (n,), generator=g).tolist())


def _train(trainer_cls, config_cls, data, compiled: bool, output_dir, **config) -> list[dict]:
    """Two steps of ``trainer_cls`` on a tiny Qwen3 with LoRA; the logged steps."""
    args = config_cls(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=2, report_to=[],
                      use_cpu=True, save_strategy="no", seed=0, data_seed=0, bf16=False, logging_steps=1,
                      max_length=16, dataloader_drop_last=True, torch_compile=compiled,
                      torch_compile_backend="sloth" if compiled else None, **config)
    lora = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0)
    trainer = trainer_cls(model=build("qwen3", torch.float32), args=args, train_dataset=data,
                          processing_class=word_tokenizer(), peft_config=lora)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def _assert_like_eager(eager: list[dict], compiled: list[dict], metrics: tuple[str, ...]) -> None:
    assert len(eager) == len(compiled) == 2, (eager, compiled)
    for step, (e, s) in enumerate(zip(eager, compiled)):
        for key in metrics:
            assert s[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), (step, key, s[key], e[key])


def _assert_report(packed: bool = False) -> None:
    """Every compiled model forward (one per row length; the report sums over them) has the tiny Qwen3's sites:
    per layer input, post-attention, q and k norms, and the final norm; RoPE; the GLU; q/k/v, o, gate/up and
    down adapters; under packing each layer's attention."""
    report = sloth.report()
    counts = dict(report.counts)
    forwards = counts.get("rms_norm", 0) // 9
    per_forward = {"rms_norm": 9, "rope": 2, "glu": 2, "lora": 14, "token_logprobs": 1,
                   **({"packed_attention": 2} if packed else {})}
    # no cross_entropy: TRL's fused head computes the loss (module docstring), as sloth's token_logprobs op
    # (compiler/integrations/trl_head.py)
    assert forwards >= 1 and counts == {k: v * forwards for k, v in per_forward.items()}, str(report)
    assert not report.unexplained, str(report)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_trainer_matches_eager(tmp_path, packing: bool) -> None:
    """Rows of 3-11 words: padded per batch (a new length on the second step: one more graph, with a symbolic
    length) or packed into rows of ``max_length`` (position ids restarting per document: sloth's packed
    attention in every layer)."""
    g = torch.Generator().manual_seed(3)
    data = datasets.Dataset.from_list([{"text": _text(g, int(n))} for n in torch.randint(3, 12, (8,), generator=g)])
    eager = _train(trl.SFTTrainer, trl.SFTConfig, data, False, tmp_path / "eager", packing=packing)
    sloth.reset_report()
    compiled = _train(trl.SFTTrainer, trl.SFTConfig, data, True, tmp_path / "sloth", packing=packing)
    _assert_like_eager(eager, compiled, METRICS)
    _assert_report(packed=packing)


def test_sft_trainer_completion_only_loss_matches_eager(tmp_path) -> None:
    """Prompt-completion rows with ``completion_only_loss``: the prompt's labels are -100, the loss and the
    metrics over the completions only, as eager's."""
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(2, 7, (8, 2), generator=g).tolist()
    data = datasets.Dataset.from_list([{"prompt": _text(g, a), "completion": _text(g, b)} for a, b in lengths])
    eager = _train(trl.SFTTrainer, trl.SFTConfig, data, False, tmp_path / "eager", completion_only_loss=True)
    sloth.reset_report()
    compiled = _train(trl.SFTTrainer, trl.SFTConfig, data, True, tmp_path / "sloth", completion_only_loss=True)
    _assert_like_eager(eager, compiled, METRICS)
    assert all(e["num_tokens"] == s["num_tokens"] for e, s in zip(eager, compiled))
    _assert_report()


def test_dpo_trainer_matches_eager(tmp_path) -> None:
    """DPO with the reference model the adapter-disabled base (peft): the policy's and the reference's forwards
    both compiled; the DPO loss, rewards and log-probabilities as eager's."""
    g = torch.Generator().manual_seed(5)
    data = datasets.Dataset.from_list([{"prompt": _text(g, 3), "chosen": _text(g, 4), "rejected": _text(g, 5)}
                                       for _ in range(8)])
    eager = _train(trl.DPOTrainer, trl.DPOConfig, data, False, tmp_path / "eager")
    sloth.reset_report()
    compiled = _train(trl.DPOTrainer, trl.DPOConfig, data, True, tmp_path / "sloth")
    _assert_like_eager(eager, compiled, DPO_METRICS)
    _assert_report()


# ---------------------------------------------------------------------------------------------------
# A 30-step run: how many graphs, and every site fused in each
# ---------------------------------------------------------------------------------------------------

def zen_of_python() -> list[str]:
    """The 19 aphorisms of ``import this``: real text of 3 to 13 words a line, shipped with Python."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line]


def zen_tokenizer(lines: list[str]) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the words and punctuation of ``lines`` (no model hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    pre = pre_tokenizers.Whitespace()
    words = sorted({w for line in lines for w, _ in pre.pre_tokenize_str(line)})
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


@pytest.fixture
def graphs_and_reports(monkeypatch) -> list:
    """Each graph sloth compiles gets its own report, appended here. The ``sloth`` backend runs with
    ``inner="aot_eager"`` (Dynamo's graphs and sloth's passes are Inductor's; only the compile of the rewritten
    graph is skipped, tens of seconds a graph on the CPU), and the ops run their PyTorch references, not Triton's
    interpreter (their numbers are checked by the op tests and by the runs against eager above)."""
    import torch._dynamo.backends.registry as registry

    from sloth.lowering import backend_choice

    torch._dynamo.lookup_backend("sloth")  # the entry point loaded, so that the patch below is what Dynamo finds
    reports = []

    def counted(gm, example_inputs, **kwargs):
        compiled = sloth.sloth_backend(gm, example_inputs, options={"inner": "aot_eager"})
        reports.append(sloth.last_report())
        return compiled

    monkeypatch.setitem(registry._COMPILER_FNS, "sloth", counted)
    monkeypatch.setattr(backend_choice, "_INTERPRETED", False)
    return reports


# Graphs compiled over the 30 steps, measured (torch 2.13, transformers 5.25, TRL 1.16). The model's forward: one
# graph at the first step's row length, then one of symbolic length for every later length (automatic dynamic
# shapes); padded, one more for the last batch of each epoch, of one row (19 aphorisms in batches of 2: Dynamo
# specialises a size of 1). TRL's fused LM head is sloth's op inside those graphs (compiler/integrations/trl_head.py;
# TRL's own head broke each graph twice, 8 and 6 graphs in all). Nothing else makes a graph (TRL's
# num_items_in_batch, the learning rate, the step's other Python values).
MODEL_GRAPHS_30_STEPS = {False: 3, True: 2}
GRAPHS_30_STEPS = MODEL_GRAPHS_30_STEPS


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_30_steps_graphs_and_sites(tmp_path, graphs_and_reports, packing: bool) -> None:
    """30 SFT steps as TRL's defaults run them, bf16 autocast around an fp32 model, on the Zen of Python: rows padded
    per batch (lengths change every step) or packed, two rows of up to 32 tokens flattened into one (position ids
    restarting per aphorism; its length changes too). Every graph of the model's forward fuses all of its sites:
    the layer's two RMSNorms, RoPE, the GLU, the seven adapters (in bf16, as autocast runs them) and, packed, the
    attention; the final norm; TRL's head on sloth's op. The graph counts are GRAPHS_30_STEPS'."""
    lines = zen_of_python()
    tokenizer = zen_tokenizer(lines)
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=30, report_to=[],
                         use_cpu=True, save_strategy="no", seed=0, data_seed=0, logging_steps=10, max_length=32,
                         torch_compile=True, torch_compile_backend="sloth", packing=packing)
    assert args.bf16, "TRL's default: bf16 autocast"
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(
        [{"text": line} for line in lines]), processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    trainer.train()
    assert trainer.state.global_step == 30
    summary = "\n".join(str(r) for r in graphs_and_reports)
    model_graphs = [r for r in graphs_and_reports if "rms_norm" in r.counts]
    per_graph = {"rms_norm": 3, "rope": 1, "glu": 1, "lora": 7, "token_logprobs": 1,
                 **({"packed_attention": 1} if packing else {})}
    assert [dict(r.counts) for r in model_graphs] == [per_graph] * MODEL_GRAPHS_30_STEPS[packing], summary
    assert len(graphs_and_reports) == GRAPHS_30_STEPS[packing], summary
    # Padded, the mask is transformers' padding mask, read from attention_mask: packed_attention and causal_mask
    # keep it, with that reason (README: leave attention_mask out where there is no padding).
    refused = ("lora", "packed_attention") if packing else ("lora",)
    for report in graphs_and_reports:
        assert not [r for r in report.rejections if r.family in refused], str(report)
        assert all("under autocast: in bfloat16" in s.detail for s in report.sites if s.family == "lora"), str(report)
    assert all(not r.sites for r in graphs_and_reports if r not in model_graphs), summary
