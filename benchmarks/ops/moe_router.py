"""The MoE router's top-k, forward and forward+backward: sloth's op against the eager router, compiled or not.

    python -m benchmarks.ops.moe_router [--smoke]

Router logits [tokens, experts] in bf16 (the router's linear output), weights in fp32, at a bs 2 x 2048 step's
4096 tokens and at 16384: Qwen3-MoE's router (128 experts, top-8, with and without ``norm_topk_prob``), Mixtral's
(8, top-2, renormalised), GPT-OSS's (32, top-4, softmax over the k); and the bias-corrected routers in fp32 (as
their models compute them): DeepSeek-V3's (256 experts, 8 groups by top-2 sum, best 4, top-8, renormalised + 1e-20)
and GLM-4.5-Air-like flat 128 top-8. Providers:

    sloth     sloth.moe_router or sloth.moe_router_biased (what the moe_router family inserts)
    eager     the router as transformers writes it (tests/test_moe_router_op.router_pattern)
    inductor  the same function through torch.compile (Inductor)

Each returns the weights only (the indices have no gradient); every provider computes them. Errors are relative
to the eager router on fp32 logits; the logits are tie-free.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks import common
from benchmarks.ops import harness

COLUMNS = ["shape", "mode", "provider", "ms", "kernel ms", "x inductor", "peak MiB", "max rel err", "error"]
# (name, experts, k, softmax_first, renorm)
ROUTERS = [("qwen3-moe", 128, 8, True, False), ("qwen3-moe norm_topk", 128, 8, True, True),
           ("mixtral", 8, 2, True, True), ("gpt-oss", 32, 4, False, False)]


def router_pattern(logits: torch.Tensor, k: int, softmax_first: bool, renorm: bool) -> torch.Tensor:
    """The weights of the router as transformers' MoE blocks write it (fp32 softmax)."""
    if softmax_first:
        w, _ = torch.topk(torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
        return w / w.sum(dim=-1, keepdim=True) if renorm else w
    top, _ = torch.topk(logits, k, dim=-1)
    return torch.nn.functional.softmax(top, dim=-1, dtype=torch.float32)


# (name, experts, k, n_group, topk_group): sigmoid scores + bias, renormalised (sum + 1e-20)
BIASED_ROUTERS = [("deepseek-v3", 256, 8, 8, 4), ("glm-4.5-air flat", 128, 8, 1, 1)]


def biased_router_pattern(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
                          topk_group: int) -> torch.Tensor:
    """The weights of DeepSeek-V3's TopkRouter as transformers writes it (no grouping at one group)."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    if n_group > 1:
        experts = logits.shape[1]
        group_scores = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, experts // n_group).reshape(-1, experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    # sorted=True where transformers has False: the same experts, in the op's (descending) order, so that the
    # errors compare weight with weight
    w = scores.gather(1, torch.topk(choice, k=k, dim=-1, sorted=True)[1])
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20)


def _cases(token_counts: list[int], device: Any):
    """(shape name, providers, logits) for every router and token count."""
    from sloth.lowering.moe_router import moe_router
    from sloth.lowering.moe_router_biased import RENORM_ADD, moe_router_biased

    for tokens in token_counts:
        for name, experts, k, softmax_first, renorm in ROUTERS:
            def eager(l, k=k, softmax_first=softmax_first, renorm=renorm):
                return router_pattern(l, k, softmax_first, renorm)

            def ours(l, k=k, softmax_first=softmax_first, renorm=renorm):
                return moe_router(l, k, softmax_first, renorm, torch.float32)[0]

            yield f"{name}: T{tokens} E{experts} top-{k}", {"sloth": ours, "eager": eager}, \
                _distinct_logits(tokens, experts, device, torch.bfloat16)
        for name, experts, k, n_group, topk_group in BIASED_ROUTERS:
            bias = (torch.rand(experts, generator=torch.Generator().manual_seed(1)) * 0.1).to(device)

            def eager(l, bias=bias, k=k, n_group=n_group, topk_group=topk_group):
                return biased_router_pattern(l, bias, k, n_group, topk_group)

            def ours(l, bias=bias, k=k, n_group=n_group, topk_group=topk_group):
                return moe_router_biased(l, bias, k, "sigmoid", False, n_group, topk_group, True, float("-inf"),
                                         RENORM_ADD, 1e-20, torch.float32)[0]

            yield f"{name}: T{tokens} E{experts} top-{k}", {"sloth": ours, "eager": eager}, \
                _untied_biased_logits(tokens, experts, bias, k, n_group, topk_group, device)


def _distinct_logits(tokens: int, experts: int, device: Any, dtype: torch.dtype,
                     gen: torch.Generator | None = None) -> torch.Tensor:
    # Distinct logits in each row (a random permutation of a grid bf16 holds exactly): with ties the op and
    # torch.topk may choose different, equally right, experts, and the errors would compare those.
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    ranks = torch.rand(tokens, experts, generator=gen).argsort(-1).float()
    return ((ranks - experts / 2) * (8 / experts)).to(device, dtype).requires_grad_()


def _untied_biased_logits(tokens: int, experts: int, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                          device: Any) -> torch.Tensor:
    """``_distinct_logits`` with every row that would tie redrawn: distinct logits can still give equal choice
    values ``sigmoid(l) + bias`` in fp32 (2 rows of 16384 at DeepSeek-V3's router did, on 2026-12-05: the op took
    the lower expert index, torch.topk the other, and the 1.8e-2 "error" compared two equally right choices).
    Redrawn where two of a row's group scores are equal, or two of its k + 1 largest choices within the
    ``topk_group`` groups kept (``biased_router_pattern``'s mask)."""
    logits = _distinct_logits(tokens, experts, "cpu", torch.float32).detach()
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        choice = logits.sigmoid() + bias.cpu()
        tied = torch.zeros(tokens, dtype=torch.bool)
        if n_group > 1:
            groups = choice.view(tokens, n_group, -1).topk(2, dim=-1).values.sum(-1)
            ordered = groups.sort(-1).values
            tied |= (ordered[:, 1:] == ordered[:, :-1]).any(-1)
            kept = torch.zeros_like(groups).scatter_(1, groups.topk(topk_group, dim=-1).indices, 1).bool()
            choice = choice.masked_fill(~kept.repeat_interleave(experts // n_group, dim=1), float("-inf"))
        top = choice.topk(k + 1, dim=-1).values
        tied |= (top[:, 1:] == top[:, :-1]).any(-1)
        rows = tied.nonzero().flatten()
        if not len(rows):
            return logits.to(device).requires_grad_()
        logits[rows] = _distinct_logits(len(rows), experts, "cpu", torch.float32, gen).detach()
    raise RuntimeError("moe_router benchmark: could not draw router logits without ties")


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)

    token_counts = [37] if args.smoke else [4096, 16384]
    rows: list[dict[str, Any]] = []
    for shape, providers, logits in _cases(token_counts, device):
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)
        providers["inductor"] = torch.compile(providers["eager"], dynamic=False)
        eager = providers["eager"]
        full = logits.detach().float().requires_grad_()
        ref = eager(full)
        dy = torch.randn(ref.shape, generator=gen).to(device)
        ref_grads = torch.autograd.grad(ref, [full], dy)
        for mode in ("fwd", "fwd+bwd"):
            base = None
            for provider, fn in reversed(providers.items()):  # inductor first: the others' ratio to it
                row: dict[str, Any] = {"shape": shape, "mode": mode, "provider": provider}
                try:
                    row["max rel err"] = harness.max_rel_err(fn, [logits], mode, [ref.detach()], ref_grads, [dy])
                    ms, kernel, peak = harness.time_case(fn, [logits], mode)
                except Exception as exc:  # noqa: BLE001 - a provider that cannot run this shape is a row
                    row["error"] = f"{type(exc).__name__}: {exc}"[:160]
                    rows.append(row)
                    print(f"{shape} {mode} {provider}: {row['error']}", flush=True)
                    continue
                base = ms if provider == "inductor" else base
                row.update({"ms": ms, "kernel ms": kernel, "x inductor": base / ms if base else None,
                            "peak MiB": peak / common.MiB if peak is not None else None})
                rows.append(row)
                print(f"{shape} {mode:<7} {provider:<8} {ms:8.4f} ms (kernel {kernel or float('nan'):8.4f}) "
                      f"err {row['max rel err']:.2e}", flush=True)
    print(common.render_text(COLUMNS, rows), flush=True)
    if not args.smoke:
        record = common.result_record("moe_router", {"logits": "bfloat16", "weights": "float32",
                                                     "routers": ROUTERS,
                                                     "biased routers (fp32 logits)": BIASED_ROUTERS}, COLUMNS, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
