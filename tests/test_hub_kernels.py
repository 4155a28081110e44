"""compiler/integrations/hub_kernels.py: the ``kernels`` package's routing store (transformers 5.25's
``use_kernelized_func``) inside gradient-checkpointed layers.

What it must do: a checkpointed layer whose class is ``use_kernelized_func``-decorated traces in one graph (the
package's own store splits it: checked in a process with the adjustment off); the same numbers and gradients as
eager; a model whose wrapper routes to another forward (as ``kernels.kernelize`` does) still calls that forward
when compiled. transformers' own checkpointed models are tests/test_models.py's and the pattern tests'.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sloth  # noqa: F401  (importing sloth adjusts the package's store, before or after it is imported)

kernels = pytest.importorskip("kernels", reason="Hugging Face's kernels package (a dependency of transformers 5.25)")
from kernels import use_kernel_forward_from_hub, use_kernelized_func  # noqa: E402


@use_kernel_forward_from_hub("SlothTestRotateHalf")
def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@use_kernelized_func(rotate_half)
class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + rotate_half(self.proj(x)).tanh()


class Net(torch.nn.Module):
    """Blocks under non-reentrant checkpointing, as transformers' ``gradient_checkpointing_enable()`` runs them."""

    def __init__(self, width=6, depth=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def _graphs_output_grads(model, x):
    """(graphs Dynamo made, output, parameter gradients) for one compiled forward + backward."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.zero_grad()
    out = torch.compile(model, backend=counting)(x)
    out.square().sum().backward()
    return len(graphs), out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _eager(model, x):
    model.zero_grad()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointed_kernelized_layers_trace_in_one_graph_with_eager_numbers():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 5, 6)
    graphs, out, grads = _graphs_output_grads(model, x)
    eager_out, eager_grads = _eager(model, x)
    assert graphs == 1
    torch.testing.assert_close(out, eager_out, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=0, atol=1e-6, msg=name)


def test_a_routed_forward_is_still_called_when_compiled():
    torch.manual_seed(1)
    model, x = Net(depth=2), torch.randn(2, 5, 6)
    plain = model(x).detach()

    def doubled(self, y):  # stands for a hub kernel kernelize() would install on the model's private wrapper
        return 2.0 * rotate_half.__class__.forward(self, y)

    for block in model.blocks:
        (wrapper,) = block._kernel_funcs.values()
        wrapper.forward = types.MethodType(doubled, wrapper)
    graphs, out, grads = _graphs_output_grads(model, x)
    eager_out, eager_grads = _eager(model, x)
    assert not torch.allclose(eager_out, plain)  # the routing is live in eager
    torch.testing.assert_close(out, eager_out, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=0, atol=1e-6, msg=name)


def _in_a_fresh_process(code: str, **env) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                            env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(
                                [os.path.dirname(root), root, os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


GRAPHS = ("import torch; from tests.test_hub_kernels import Net, _graphs_output_grads; "
          "from sloth.compiler.integrations import hub_kernels as h; torch.manual_seed(0); "
          "print(h._registered, _graphs_output_grads(Net(), torch.randn(2, 5, 6))[0])")


def test_opt_out_leaves_the_package_alone_and_its_store_keeps_the_layers_out_of_one_graph():
    registered, graphs = _in_a_fresh_process(GRAPHS, SLOTH_HUB_KERNELS_TRACEABLE="0").split()
    # what the adjustment is for, so the one-graph test above can fail: Dynamo gives up on the checkpointed
    # bodies (torch 2.13: the whole frame runs eagerly, no graph at all)
    assert registered == "False" and int(graphs) != 1


@pytest.mark.parametrize("order", ["sloth-first", "kernels-first", "sloth-only"])
def test_registered_whichever_is_imported_first_and_kernels_never_imported_for_it(order):
    imports = {"sloth-first": "import sloth; import kernels; ", "kernels-first": "import kernels; import sloth; ",
               "sloth-only": "import sloth; "}[order]
    check = ("import sys; from sloth.compiler.integrations import hub_kernels as h; "
             "print(h._registered, 'kernels._internals.layer.layer' in sys.modules)")
    assert _in_a_fresh_process(imports + check) == ("False False" if order == "sloth-only" else "True True")
