"""torch.compile of the small GPT (causal_attention.models.GPT) with fullgraph=True, static and
dynamic=True: no graph break, and the forward and a training step (through our backward op)
match eager. The compiled models are tiny and compiled three times in all, compilation being
slow."""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from causal_attention.models import GPT
from nn_testing import IGNORE_TORCHSCRIPT_DEPRECATION

# Dynamo inspects the attention module's TorchScript-exported methods, which warns.
pytestmark = IGNORE_TORCHSCRIPT_DEPRECATION

VOCAB = 64


def tiny_gpt() -> GPT:
    return GPT(VOCAB, 32, 32, 4, 2, num_kv_heads=2, value_head_dim=12)


def training_step(model, tokens, targets, parameters_of):
    """Loss of ``model``, and the gradients of one step in the parameters of ``parameters_of``
    (the eager module, whose parameters a compiled module shares), before an optimizer uses
    them."""
    parameters_of.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in parameters_of.named_parameters()}


def assert_step_matches_eager(eager, compiled, length):
    tokens = torch.randint(0, VOCAB, (3, length))
    targets = torch.randint(0, VOCAB, (3, length))
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), eager(tokens), atol=1e-5, rtol=1e-5)
    loss, grads = training_step(eager, tokens, targets, eager)
    compiled_loss, compiled_grads = training_step(compiled, tokens, targets, eager)
    torch.testing.assert_close(compiled_loss, loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    assert not torch._dynamo.utils.counters["graph_break"], dict(
        torch._dynamo.utils.counters["graph_break"]
    )
    torch._dynamo.reset()


def test_compiled_fullgraph_matches_eager():
    eager = tiny_gpt()
    compiled = torch.compile(eager, fullgraph=True)
    assert_step_matches_eager(eager, compiled, length=20)


def test_compiled_dynamic_matches_eager_at_new_lengths_without_recompiling():
    eager = tiny_gpt()
    compiled = torch.compile(eager, fullgraph=True, dynamic=True)
    assert_step_matches_eager(eager, compiled, length=20)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in (7, 32):
            assert_step_matches_eager(eager, compiled, length=length)


def test_compiled_graphs_call_our_forward_and_backward_ops():
    graphs = {}

    def keep(kind):
        def compiler(graph_module, example_inputs):
            graphs[kind] = graph_module.graph
            return make_boxed_func(graph_module.forward)

        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    model = tiny_gpt()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    tokens, targets = torch.randint(0, VOCAB, (2, 2, 9))
    training_step(compiled, tokens, targets, model)
    targets = {kind: {str(node.target) for node in graph.nodes} for kind, graph in graphs.items()}
    assert "causal_attention.attention_forward.default" in targets["forward"], targets["forward"]
    assert "causal_attention.attention_backward.default" in targets["backward"], targets["backward"]
    assert not any("scaled_dot_product" in t for kind in targets.values() for t in kind)
