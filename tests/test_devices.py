"""The runtime follows the model: its device, its precision, and the torch it runs on.

* ``parallelize`` takes the mesh's device from the parameters; a model on the meta device, on several
  devices, or on a GPU with a gloo-only process group ends in one line saying what to do (the CUDA case
  through fake CUDA tensors: this machine has no GPU).
* Plans record their precision: ``bf16-mixed`` traces the step under autocast (bfloat16 matmuls with
  float32 parameters and gradients), ``bf16`` in bfloat16 throughout; both run and match eager PyTorch
  doing the same within bfloat16's resolution (1e-2 relative).
* A private torch symbol that moved (hidden on purpose) turns the feature that needs it off by name: the op is
  replicated and the plan's warning names the missing symbol, where an ImportError used to end planning.

Runs in this process with a one-rank gloo group (nothing is spawned).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from meshpilot.errors import UserError


def _gpt(dtype=torch.float32):
    from meshpilot.models.gpt import GPT, gpt_tiny

    torch.manual_seed(0)
    model = GPT(gpt_tiny(batch=4, seq=8)).to(dtype)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (4, 9), generator=g)
    return model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())


def _plan(model, inputs, **kw):
    import meshpilot

    return meshpilot.plan(model, inputs, "dgx-h100", num_devices=1, **kw).only


# ------------------------------------------------------------------------------------------- devices


def test_meta_model_is_refused_with_a_way_out(group):
    from meshpilot.runtime.spmd import parallelize

    model, inputs = _gpt()
    plan = _plan(model, inputs)
    with torch.device("meta"):
        meta, _ = _gpt()
    with pytest.raises(UserError, match="meta device.*to_empty"):
        parallelize(meta, plan)


def test_parameters_on_several_devices_are_refused():
    from meshpilot.runtime.spmd import model_device

    model, _ = _gpt()
    model.lm_head.weight = torch.nn.Parameter(torch.empty(model.lm_head.weight.shape, device="meta"))
    with pytest.raises(UserError, match=r"several devices \(cpu, meta\).*move it to one"):
        model_device(model)


def test_cuda_model_needs_nccl(group, monkeypatch):
    """A model whose parameters are (fake) CUDA tensors, in a gloo-only group: one line naming NCCL."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshpilot.runtime import spmd

    model, inputs = _gpt()
    plan = _plan(model, inputs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for m in model.modules():
            for k, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[k] = torch.nn.Parameter(torch.empty(p.shape, device="cuda"))
    assert spmd.model_device(model).type == "cuda"
    with pytest.raises(UserError, match=r"on cuda.*backend is 'gloo'.*init_process_group\('nccl'\)"):
        spmd.parallelize(model, plan)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with pytest.raises(UserError, match=r"this rank's CUDA device is cuda:1.*cuda:LOCAL_RANK"):
        spmd.check_backend(torch.device("cuda", 0))


def test_cpu_model_runs_on_a_cpu_mesh(group):
    from meshpilot.runtime.spmd import parallelize

    model, inputs = _gpt()
    ref, _ = _gpt()
    pm = parallelize(model, _plan(model, inputs))
    assert pm.mesh.device_type == "cpu" and pm.device.type == "cpu"
    loss = pm(*inputs)
    loss.backward()
    assert abs(loss.item() - ref(*inputs).item()) < 1e-6
    assert "def forward" in pm.program.forward_gm.code  # the step is generated code
    with pytest.raises(UserError, match=r"input 0 is \(2, 8\).*plan again"):
        pm(inputs[0][:2], inputs[1][:2])


def test_cudagraphs_needs_a_cuda_mesh(group):
    from meshpilot.runtime.spmd import parallelize

    model, inputs = _gpt()
    with pytest.raises(UserError, match=r"compile='cudagraphs'.*cpu mesh with 1 microbatches.*compile=True"):
        parallelize(model, _plan(model, inputs), compile="cudagraphs")


# ------------------------------------------------------------------------------------------- precision


def test_mixed_precision_runs_as_autocast_does(group):
    from meshpilot.runtime.spmd import parallelize

    model, inputs = _gpt()
    plan = _plan(model, inputs, precision="bf16-mixed")
    assert plan.precision == "bf16-mixed"
    assert type(plan).from_json(plan.to_json()).precision == "bf16-mixed"
    mms = [n for n in plan.nodes if n.target == "aten.mm.default"]
    assert mms
    ref, _ = _gpt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(*inputs)
    want.backward()
    pm = parallelize(model, plan)
    got = pm(*inputs)
    got.backward()
    assert got.dtype == torch.float32 and abs(got.item() - want.item()) <= 1e-2 * abs(want.item())
    for (name, a), b in zip(ref.named_parameters(), pm.parameters()):
        assert b.dtype == torch.float32 and b.grad.dtype == torch.float32  # fp32 master weights and grads
        got_grad = b.grad.full_tensor() if hasattr(b.grad, "full_tensor") else b.grad  # 1 device: plain
        err = (a.grad - got_grad).abs().max().item()
        assert err <= 1e-2 * max(a.grad.abs().max().item(), 1e-3), (name, err)


def test_factories_and_casts_run_on_the_mesh_device():
    """Capture runs on CPU (or meta) tensors, so `arange` and autocast's `_to_copy` record `device=cpu`; the
    runtime calls them on the rank's device (on an H100 the bf16-mixed GPT failed in `mm` with a CPU operand)."""
    from meshpilot.graph.capture import capture
    from meshpilot.runtime.interpret import NodeCall

    model, inputs = _gpt()
    graph = capture(model, inputs, precision="bf16-mixed")
    plan = _plan(model, inputs, precision="bf16-mixed", graph=graph)
    on_cpu = [n for n in graph.nodes if n.fx_node is not None and torch.device("cpu") in n.fx_node.kwargs.values()]
    targets = {str(n.target) for n in on_cpu}
    assert {"aten.arange.default", "aten._to_copy.default"} <= targets, targets
    meta = torch.device("meta")
    for node in on_cpu:
        call = NodeCall(node, plan.node(node.name), None, meta)
        operands = [torch.empty(v.shape, dtype=v.dtype, device=meta) for v in _operand_vals(node)]
        _, kwargs = call.arguments(operands)
        assert kwargs["device"] == meta, node.name
        assert call.target(*call.arguments(operands)[0], **kwargs).device == meta, node.name


def _operand_vals(node):
    return [a.meta["val"] for a in node.fx_node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def test_bf16_plan_trains_the_model_in_bf16(group):
    from meshpilot.runtime.spmd import parallelize

    model, inputs = _gpt()
    plan = _plan(model, inputs, precision="bf16")
    assert plan.memory.params == _plan(model, inputs).memory.params / 2  # 2 bytes a parameter
    ref, _ = _gpt(torch.bfloat16)
    want = ref(*inputs)
    pm = parallelize(model, plan)
    assert all(p.dtype == torch.bfloat16 for p in pm.parameters())
    got = pm(*inputs)
    assert abs(got.item() - want.item()) <= 1e-2 * abs(want.item())


def test_unknown_precision_is_one_line():
    model, inputs = _gpt()
    with pytest.raises(UserError, match=r"precision 'fp8': choose one of fp32, bf16, fp16, bf16-mixed"):
        _plan(model, inputs, precision="fp8")


# ------------------------------------------------------------------------------------------- torch range


def test_a_moved_private_symbol_degrades_by_name():
    """With GroupNorm's scalar adjuster hidden, the wrn-tiny model still plans: GroupNorm's backward is
    replicated and the warning says which symbol this torch lacks."""
    code = (
        "import torch, meshpilot\n"
        "from meshpilot.models import builtin_models\n"
        "model, inputs = builtin_models()['wrn-tiny'].build('meta', 4)\n"
        "p = meshpilot.plan(model, inputs, 'atp-ic3', mesh_shape=(2, 1)).only\n"
        "print('\\n'.join(p.warnings))\n"
    )
    env = dict(os.environ, MESHPILOT_COMPAT_HIDE="torch.distributed.tensor._ops._math_ops._adjust_group_norm_scalars")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ImportError" not in out.stderr
    lines = [w for w in out.stdout.splitlines() if "native_group_norm_backward" in w]
    assert lines and all("replicated" in w and "has no _adjust_group_norm_scalars" in w for w in lines), out.stdout
