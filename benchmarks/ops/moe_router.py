"""The MoE router's top-k, forward and forward+backward: sloth's op against the eager router, compiled or not.

    python -m benchmarks.ops.moe_router [--smoke]

Router logits [tokens, experts] in bf16 (the router's linear output), weights in fp32, at a bs 2 x 2048 step's
4096 tokens and at 16384: Qwen3-MoE's router (128 experts, top-8, with and without ``norm_topk_prob``), Mixtral's
(8, top-2, renormalised), GPT-OSS's (32, top-4, softmax over the k). Providers:

    sloth     sloth.moe_router (what the moe_router family inserts)
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


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering.moe_router import moe_router

    token_counts = [37] if args.smoke else [4096, 16384]
    rows: list[dict[str, Any]] = []
    for tokens in token_counts:
        for name, experts, k, softmax_first, renorm in ROUTERS:
            torch._dynamo.reset()
            gen = torch.Generator().manual_seed(0)
            # Distinct logits in each row (a random permutation of a grid bf16 holds exactly): with ties the op
            # and torch.topk may choose different, equally right, experts, and the errors would compare those.
            ranks = torch.rand(tokens, experts, generator=gen).argsort(-1).float()
            logits = ((ranks - experts / 2) * (8 / experts)).to(device, torch.bfloat16).requires_grad_()

            def eager(l, k=k, softmax_first=softmax_first, renorm=renorm):
                return router_pattern(l, k, softmax_first, renorm)

            def ours(l, k=k, softmax_first=softmax_first, renorm=renorm):
                return moe_router(l, k, softmax_first, renorm, torch.float32)[0]

            providers = {"sloth": ours, "eager": eager, "inductor": torch.compile(eager, dynamic=False)}
            full = logits.detach().float().requires_grad_()
            ref = eager(full)
            dy = torch.randn(ref.shape, generator=gen).to(device)
            ref_grads = torch.autograd.grad(ref, [full], dy)
            shape = f"{name}: T{tokens} E{experts} top-{k}"
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
                                                     "routers": ROUTERS}, COLUMNS, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
