"""TRL's fused LM head run by sloth's op in a step compiled with sloth (compiler/integrations/trl_head.py): TRL's five
outputs and their gradients against TRL's own head (its PyTorch path on the CPU), in the graph with no break and in
the report; TRL's head under any other backend, with the family disabled, and after sloth's op failed."""
from __future__ import annotations

import logging

import pytest
import torch

import sloth
from sloth.compiler.integrations import trl_head

pytest.importorskip("trl")
trl_utils = pytest.importorskip("trl.trainer.utils")

ALL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture
def head():
    installed = trl_utils._ChunkedLogProbFunction
    assert isinstance(installed, trl_head.SlothLMHead), "import sloth put sloth's head in TRL's place"
    installed.failed = None
    return installed


def call(outputs, softcap=None, logit_scale=1.0, temperature=1.0, bias=False, trained=False, device="cpu"):
    """``fn(h, labels)`` calling TRL's head as add_fused_lm_head does (every row, as on the CPU; on a GPU TRL
    passes the labelled rows alone, which the head sees the same way), and the head's parameters."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(61, 12, generator=g) * 0.5).to(device).requires_grad_(trained)
    b = torch.randn(61, generator=g).to(device).requires_grad_(trained) if bias else None

    def fn(h, labels):
        return trl_utils._ChunkedLogProbFunction.apply(h.reshape(-1, h.shape[-1]), w, b, labels.reshape(-1),
                                                       temperature, 32768, softcap, logit_scale, outputs)
    return fn, [p for p in (w, b) if p is not None]


def outputs_and_grads(fn, params, h, labels):
    h = h.detach().requires_grad_(True)
    out = fn(h, labels)
    differentiable = [o for o in out if o is not None and o.requires_grad]
    loss = sum((o * (i + 1)).sum() for i, o in enumerate(differentiable))
    grads = torch.autograd.grad(loss, [h, *(p for p in params if p.requires_grad)])
    return [o.detach() if o is not None else None for o in out], grads


def inputs(device="cpu"):
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 5, 12, generator=g).to(device), torch.randint(0, 61, (3, 5), generator=g).to(device)


@pytest.mark.parametrize("case", [
    dict(outputs=("log_probs",)),
    dict(outputs=ALL),
    dict(outputs=("log_probs", "entropy", "is_top1"), softcap=4.0, logit_scale=0.7, temperature=1.3, bias=True),
    dict(outputs=("log_probs", "entropy"), trained=True, bias=True),
], ids=["dpo", "all", "sft-capped", "full-fine-tuning"])
def test_under_sloth_the_head_is_sloths_with_trls_values(case, head, device):
    # on a GPU (the lane's --device cuda) against TRL's Triton kernels, on the CPU against its PyTorch path
    fn, params = call(**case, device=device)
    h, labels = inputs(device)
    want, want_grads = outputs_and_grads(fn, params, h, labels)  # eager: TRL's own head
    got, got_grads = outputs_and_grads(torch.compile(fn, backend="sloth", fullgraph=True), params, h, labels)
    for name, a, b in zip(ALL, got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    sites = [s for s in sloth.report().sites if s.family == "token_logprobs"]
    assert len(sites) == 1 and sites[0].op == "sloth.linear_token_logprobs", sloth.report()


def test_under_autocast_the_product_is_in_autocasts_dtype(head, device):
    # TRL casts the hidden states and the head to autocast's dtype for its matmul; sloth's op does the same
    fn, params = call(("log_probs", "entropy"), device=device)
    h, labels = inputs(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        want, want_grads = outputs_and_grads(fn, params, h, labels)
        got, got_grads = outputs_and_grads(torch.compile(fn, backend="sloth", fullgraph=True), params, h, labels)
    for a, b in zip(got[:2] + list(got_grads), want[:2] + list(want_grads)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert sloth.report().counts.get("token_logprobs") == 1


@pytest.mark.parametrize("how", ["eager", "inductor", "disabled"])
def test_elsewhere_trls_head_runs(how, head, monkeypatch):
    calls = []
    trl_apply = head.trl_head.apply
    monkeypatch.setattr(head.trl_head, "apply", lambda *a: calls.append(1) or trl_apply(*a))
    fn, params = call(("log_probs",))
    h, labels = inputs()
    if how == "eager":
        fn(h, labels)
    else:
        backend = "sloth" if how == "disabled" else "inductor"
        options = {"disable": ["token_logprobs"]} if how == "disabled" else None
        torch.compile(fn, backend=backend, options=options)(h, labels)
    assert calls, "TRL's own head ran"
    assert sloth.report().counts.get("token_logprobs") is None


def test_a_failure_of_sloths_op_gives_trls_head_for_good(head, monkeypatch, caplog):
    # run eagerly inside a compile with sloth (a frame Dynamo gave up on): sloth's op raises, TRL's head answers
    monkeypatch.setattr(trl_head, "_running_under_sloth", lambda: True)

    def broken(*args):
        raise RuntimeError("no kernel for this device")
    monkeypatch.setattr(trl_head, "_sloth_head", broken)
    fn, params = call(("log_probs",))
    h, labels = inputs()
    with caplog.at_level(logging.WARNING, logger="sloth"):
        got = fn(h, labels)[0]
    monkeypatch.setattr(trl_head, "_running_under_sloth", lambda: False)
    torch.testing.assert_close(got, fn(h, labels)[0])
    assert head.failed == "RuntimeError: no kernel for this device" and "TRL's own head runs" in caplog.text


def test_run_eagerly_under_sloth_the_report_gets_the_site(head, monkeypatch):
    monkeypatch.setattr(trl_head, "_running_under_sloth", lambda: True)
    fn, params = call(("log_probs", "is_top1"))
    h, labels = inputs()
    got = fn(h, labels)
    monkeypatch.setattr(trl_head, "_running_under_sloth", lambda: False)
    want = fn(h, labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[4], want[4])
    fn(h, labels)  # once per report
    assert [s.detail for s in sloth.report().sites] == [trl_head.SITE_DETAIL]


def test_sloths_backend_through_a_partial_and_in_explain(head):
    # functools.partial(sloth_backend, options=...) is sloth's backend too, and sloth.explain shows what it runs
    import functools

    fn, params = call(("log_probs", "entropy"))
    h, labels = inputs()
    want = fn(h, labels)
    backend = functools.partial(sloth.sloth_backend, options={"report": False})
    got = torch.compile(fn, backend=backend, fullgraph=True)(h, labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert sloth.report().counts.get("token_logprobs") == 1
    torch._dynamo.reset()
    assert sloth.explain(fn, h, labels).counts.get("token_logprobs") == 1


def test_trls_conventions_int32_labels_and_a_softcap_of_zero(head):
    # TRL takes any integer labels, and reads a softcap of 0.0 as a cap of 1.0 (``softcap or 1.0``)
    fn, params = call(("log_probs",), softcap=0.0)
    h, labels = inputs()
    want = fn(h, labels.int())
    got = torch.compile(fn, backend="sloth", fullgraph=True)(h, labels.int())
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
