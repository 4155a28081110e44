"""TRL's preference and RL trainers (``DPOTrainer``, ``GRPOTrainer``'s loss step) on a tiny Llama with peft LoRA,
``torch_compile=True, torch_compile_backend="sloth"``, against the same run eagerly, and what sloth's
``token_logprobs`` family finds in their graphs.

Every logged metric of every step equals eager's (fp32: rel 1e-4, abs 1e-5). The reference model is the policy
with its adapters disabled (peft, no ``ref_model``), as TRL does.

Where the ``token_logprobs`` sites come from: TRL 1.16's DPO, GRPO, RLOO and KTO trainers never call
``selective_log_softmax`` (trl/trainer/utils.py:538) or ``entropy_from_logits`` (:604); only experimental trainers
(ORPO, CPO, SDPO, ...) and ``selective_log_softmax_and_entropy`` still do. They patch the model with
``add_fused_lm_head`` (trl/trainer/utils.py:1548, e.g. trl/trainer/dpo_trainer.py:960, trl/trainer/grpo_trainer.py:1068)
and call it with ``fused_lm_head=True`` (dpo_trainer.py:1299 and :1336, grpo_trainer.py:1498), which projects the
hidden states through ``trl.kernels.ChunkedLogProbFunction.apply`` (trl/trainer/utils.py:1644): no ``log_softmax`` in
any graph for the family's pass to anchor on. Under sloth that call is sloth's ``linear_token_logprobs``
(compiler/integrations/trl_head.py), traced into the model's graph: one site per model forward, reported as traced
in. The unfused helper's spellings (``selective_log_softmax``'s float32 ``gather - stack([logsumexp(row)])`` and its
bf16 per-row ``log_softmax``; ``entropy_from_logits``) are matched by the pass (tests/test_token_logprobs_pattern.py).

GRPO needs completions from generation (transformers' ``generate`` or vLLM); here ``_generate_and_score_completions``
is replaced by one that returns fixed prompts, completions and advantages, so the trainer runs only its loss step
(``compute_loss``: the policy's and, with ``beta`` > 0, the adapter-disabled reference's log-probabilities, the
clipped ratio and the KL term).
"""
from __future__ import annotations

import math

import pytest
import torch

import sloth

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

from test_trl import _text as words_text, word_tokenizer  # noqa: E402  (after the skips: it imports trl)

VOCAB = 128
WORDS = [f"w{i}" for i in range(VOCAB - 4)]
RTOL, ATOL = 1e-4, 1e-5
# The families of one forward of the tiny Llama (2 layers) with LoRA on every linear: per layer two norms, and the
# final one; RoPE; the GLU; the seven adapters. (Nothing for the head: TRL's fused head, module docstring.)
PER_FORWARD = {"rms_norm": 5, "rope": 2, "glu": 2, "lora": 14, "token_logprobs": 1}


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _text(g: torch.Generator, n: int) -> str:
    return words_text(g, n, WORDS)


def _lora() -> "peft.LoraConfig":
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def _common(output_dir, compiled: bool) -> dict:
    return dict(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
                save_strategy="no", seed=0, data_seed=0, bf16=False, logging_steps=1, dataloader_drop_last=True,
                learning_rate=1e-2, torch_compile=compiled, torch_compile_backend="sloth" if compiled else None)


def _assert_like_eager(eager: list[dict], compiled: list[dict], must: tuple[str, ...]) -> None:
    """Every logged number of every step (not just ``must``, which each step has to log) equals eager's."""
    assert len(eager) == len(compiled) == 2, (eager, compiled)
    for step, (e, s) in enumerate(zip(eager, compiled)):
        assert set(must) <= set(e) and set(e) == set(s), (step, sorted(e), sorted(s))
        for key, value in e.items():
            if key in ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second",
                       "train_loss", "total_flos", "epoch") or not isinstance(value, (int, float)):
                continue
            if key == "rewards/accuracies" and abs(e["rewards/margins"]) < 1e-3:
                # The first step's policy is the reference (LoRA's B is zero): every reward is 0 up to rounding,
                # and the share of pairs whose rounding noise has chosen > rejected is noise too (compiled, the
                # policy's and the reference's forwards are different graphs). The margins themselves are compared.
                continue
            if math.isnan(value):
                assert math.isnan(s[key]), (step, key, s[key], value)
                continue
            assert s[key] == pytest.approx(value, rel=RTOL, abs=ATOL), (step, key, s[key], value)


def _assert_report() -> dict:
    """The model forwards' sites, TRL's head among them as sloth's op, and no refusal or unexplained anchor (module
    docstring)."""
    report = sloth.report()
    counts = dict(report.counts)
    forwards = counts.get("rms_norm", 0) // PER_FORWARD["rms_norm"]
    assert forwards >= 1 and counts == {k: v * forwards for k, v in PER_FORWARD.items()}, str(report)
    assert all("integration" in s.detail for s in report.sites if s.family == "token_logprobs"), str(report)
    assert not [r for r in report.rejections if r.family == "token_logprobs"], str(report)
    assert not report.unexplained, str(report)
    return counts


# ---------------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------------

DPO_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy",
               "mean_token_accuracy")


def _train_dpo(data, compiled: bool, output_dir) -> list[dict]:
    args = trl.DPOConfig(max_length=24, beta=0.5, **_common(output_dir, compiled))
    trainer = trl.DPOTrainer(model=tiny_llama(), args=args, train_dataset=data, processing_class=word_tokenizer(WORDS),
                             peft_config=_lora())
    assert trainer.ref_model is None  # the reference is the adapter-disabled policy
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_dpo_trainer_matches_eager(tmp_path) -> None:
    """Two DPO steps (sigmoid loss, beta 0.5, a learning rate large enough that the second step's rewards are not
    zero): loss, gradient norm, rewards, margins, accuracies, log-probabilities, mean logits, entropy and token
    accuracy as eager's (the first step's accuracies aside: ``_assert_like_eager``), TRL's fused LM head on sloth's
    op in each forward (module docstring)."""
    g = torch.Generator().manual_seed(5)
    data = datasets.Dataset.from_list([{"prompt": _text(g, 3), "chosen": _text(g, 4), "rejected": _text(g, 6)}
                                       for _ in range(8)])
    eager = _train_dpo(data, False, tmp_path / "eager")
    sloth.reset_report()
    compiled = _train_dpo(data, True, tmp_path / "sloth")
    _assert_like_eager(eager, compiled, DPO_METRICS)
    assert any(abs(h["rewards/chosen"]) > 1e-4 for h in eager), eager  # the policy moved from the reference
    _assert_report()


# ---------------------------------------------------------------------------------------------------
# GRPO: the loss step on fixed completions (no generation)
# ---------------------------------------------------------------------------------------------------

PROMPT_LEN, COMPLETION_LEN = 5, 7


def _grpo_trainer_class():
    class FixedCompletionsGRPOTrainer(trl.GRPOTrainer):
        """GRPO whose "generation" returns fixed token ids (seeded by the step), padded prompts and completions
        with masks, and group-normalised advantages of a fixed reward; the reference's log-probabilities as
        TRL computes them (adapters disabled)."""

        def _generate_and_score_completions(self, inputs):
            from trl.trainer.utils import use_adapter

            n = len(inputs)
            g = torch.Generator().manual_seed(100 + self._step)
            prompt_ids = torch.randint(4, VOCAB, (n, PROMPT_LEN), generator=g)
            prompt_mask = torch.ones_like(prompt_ids)
            prompt_lens = torch.randint(2, PROMPT_LEN + 1, (n,), generator=g)
            for row, length in enumerate(prompt_lens.tolist()):  # left-padded prompts, as TRL pads them
                prompt_ids[row, :PROMPT_LEN - length] = 0
                prompt_mask[row, :PROMPT_LEN - length] = 0
            completion_ids = torch.randint(4, VOCAB, (n, COMPLETION_LEN), generator=g)
            completion_mask = torch.ones_like(completion_ids)
            completion_lens = torch.randint(2, COMPLETION_LEN + 1, (n,), generator=g)
            for row, length in enumerate(completion_lens.tolist()):  # right-padded completions
                completion_ids[row, length:] = 0
                completion_mask[row, length:] = 0
            rewards = torch.rand(n, generator=g).view(-1, self.num_generations)
            advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
            output = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                      "completion_mask": completion_mask, "advantages": advantages,
                      "num_items_in_batch": completion_mask.sum()}
            if self.beta != 0.0:
                ids = torch.cat([prompt_ids, completion_ids], dim=1)
                mask = torch.cat([prompt_mask, completion_mask], dim=1)
                model = self.accelerator.unwrap_model(self.model)
                with torch.no_grad(), use_adapter(model, adapter_name=None):
                    output["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.model, ids, mask, COMPLETION_LEN, batch_size=n)
            return output

    return FixedCompletionsGRPOTrainer


GRPO_METRICS = ("loss", "grad_norm", "entropy", "kl", "clip_ratio/region_mean")


def _train_grpo(data, compiled: bool, output_dir) -> list[dict]:
    args = trl.GRPOConfig(num_generations=2, beta=0.1, max_completion_length=COMPLETION_LEN,
                          **_common(output_dir, compiled))
    trainer = _grpo_trainer_class()(model=tiny_llama(), reward_funcs=lambda completions, **kw: [0.0] * len(
        completions), args=args, train_dataset=data, processing_class=word_tokenizer(WORDS), peft_config=_lora())
    assert trainer.ref_model is None
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_grpo_loss_step_matches_eager(tmp_path) -> None:
    """Two GRPO steps on fixed completions (module docstring), beta 0.1 so the KL against the adapter-disabled
    reference is in the loss: loss, gradient norm, entropy, KL and clip ratios as eager's; the same sites as DPO's
    (GRPO's log-probabilities come from TRL's fused head too, grpo_trainer.py:1498)."""
    g = torch.Generator().manual_seed(6)
    data = datasets.Dataset.from_list([{"prompt": _text(g, 3)} for _ in range(8)])
    eager = _train_grpo(data, False, tmp_path / "eager")
    sloth.reset_report()
    compiled = _train_grpo(data, True, tmp_path / "sloth")
    _assert_like_eager(eager, compiled, GRPO_METRICS)
    assert any(h["kl"] > 0 for h in eager), eager  # the second step's policy differs from the reference
    _assert_report()
