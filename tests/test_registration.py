"""The triton_op registration (lowering/registration.py, SLOTH_TRITON_OP=1) on the CPU: without the interpreter
every op runs its PyTorch reference, so this checks the plumbing the GPU path shares (the function as its own
fake, the decomposition AOTAutograd traces, register_autograd's backward) through aot_eager and Inductor: a
peft LoRA Llama with every family, loss and every gradient against eager. The kernels themselves under
triton_op run only on a GPU (benchmarks/e2e.py with SLOTH_TRITON_OP=1)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import torch, peft, sloth
from sloth.lowering import registration
assert registration.TRITON_OP, "SLOTH_TRITON_OP=1 without the interpreter must choose triton_op"
from test_models import VOCAB, build, loss_and_grads
model = build("llama", torch.float32)
model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"]))
with torch.no_grad():
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))

eager = loss_and_grads(model, ids)
for inner in ("aot_eager", "inductor"):
    torch._dynamo.reset()
    sloth.reset_report()
    loss, grads = loss_and_grads(model, ids, torch.compile(model, backend="sloth", options={"inner": inner}))
    counts = sloth.report().counts
    assert counts.get("lora") == 14 and counts.get("rms_norm") == 5 and counts.get("rope") == 2, counts
    torch.testing.assert_close(loss, eager[0], rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager[1][name], rtol=1e-4, atol=1e-6, msg=name)
print("ok")
'''


def test_triton_op_registration_matches_eager_on_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(SLOTH_TRITON_OP="1", PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
