"""torch.compile of the small GPT (causal_attention.models.GPT) with fullgraph=True, static and
dynamic=True: no graph break, and the forward and a training step (through our backward op)
match eager. Then the ops with a key mask, on packed sequences (varlen_attention) and with every
score option: compiled with fullgraph=True, forward and backward match eager and the graphs call
our forward and backward ops; torch.export traces them and the exported programs match eager;
dropout compiled draws what eager draws; paged_attention on 8-bit caches (each 8-bit dtype, scales
per tensor and per token) compiles with fullgraph=True and exports. Everything is tiny and
compiled as few times as the checks allow, compilation being slow."""

import pytest
import torch
import torch._dynamo
from torch import nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.export import Dim

import causal_attention
from attention_testing.inputs import Case, ScoreOptions, make_key_mask, make_tensor
from attention_testing.packed import Packed
from attention_testing.results import (
    RESULT_NAMES,
    SINK_RESULT_NAMES,
    assert_bitwise_equal,
    forward_and_grads,
)
from fixtures.tiny_gpt import TinyGPT
from nn_testing import IGNORE_TORCHSCRIPT_DEPRECATION

# Dynamo inspects the attention module's TorchScript-exported methods, which warns.
pytestmark = IGNORE_TORCHSCRIPT_DEPRECATION

VOCAB = 64  # TinyGPT's vocabulary


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
    eager = TinyGPT()
    compiled = torch.compile(eager, fullgraph=True)
    assert_step_matches_eager(eager, compiled, length=20)


def test_compiled_dynamic_matches_eager_at_new_lengths_without_recompiling():
    eager = TinyGPT()
    compiled = torch.compile(eager, fullgraph=True, dynamic=True)
    assert_step_matches_eager(eager, compiled, length=20)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in (7, 32):
            assert_step_matches_eager(eager, compiled, length=length)


def graph_keeping_backend(graphs):
    """A torch.compile backend that runs the traced graphs as they are and keeps them in
    graphs["forward"] and graphs["backward"]."""

    def keep(kind):
        def compiler(graph_module, example_inputs):
            graphs[kind] = graph_module.graph
            return make_boxed_func(graph_module.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def test_compiled_graphs_call_our_forward_and_backward_ops():
    graphs = {}
    backend = graph_keeping_backend(graphs)
    model = TinyGPT()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    tokens, targets = torch.randint(0, VOCAB, (2, 2, 9))
    training_step(compiled, tokens, targets, model)
    targets = {kind: {str(node.target) for node in graph.nodes} for kind, graph in graphs.items()}
    assert "causal_attention.attention_forward.default" in targets["forward"], targets["forward"]
    assert "causal_attention.attention_backward.default" in targets["backward"], targets["backward"]
    assert not any("scaled_dot_product" in t for kind in targets.values() for t in kind)


# --- the ops with a key mask, and on packed sequences ---------------------------------------

MASKED = Case(9, 12, 8, dv=4, hq=4, hkv=2, batch=(3,))
PACKED = Packed((4, 0, 9, 2), (4, 3, 12, 1), 8, dv=4, hq=4, hkv=2)
_CU_Q, _CU_K, MAX_Q, MAX_K = PACKED.lengths_args()


def masked_attention(q, k, v, key_mask):
    return causal_attention.attention(q, k, v, key_mask=key_mask)


def packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k):
    return causal_attention.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, MAX_Q, MAX_K)


def masked_call():
    """(function, tensors: q, k, v and the rest, grad_out) of a masked call with empty rows."""
    q, k, v = MASKED.inputs(torch.float32, requires_grad=True)
    key_mask = make_key_mask(MASKED.key_mask_shape, "one-all-false")
    return masked_attention, (q, k, v, key_mask), make_tensor(MASKED.out_shape, torch.float32)


def packed_call():
    q, k, v = PACKED.inputs(torch.float32, requires_grad=True)
    args = (q, k, v, _CU_Q, _CU_K)
    return packed_attention, args, make_tensor(PACKED.out_shape, torch.float32)


# Every score option at once, on the masked call's shapes: the slopes and the sinks are inputs
# of the graph (the sinks differentiable), the window and the softcap constants.
def options_attention(q, k, v, key_mask, alibi_slopes, sinks):
    return causal_attention.attention(
        q,
        k,
        v,
        key_mask=key_mask,
        window=(4, 1),
        softcap=3.0,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )


def options_call():
    q, k, v = MASKED.inputs(torch.float32, requires_grad=True)
    options = ScoreOptions(alibi="batch", sinks="q", key_mask="one-all-false")
    kwargs = options.for_case(MASKED, torch.float32)
    args = (q, k, v, kwargs["key_mask"], kwargs["alibi_slopes"], kwargs["sinks"])
    return options_attention, args, make_tensor(MASKED.out_shape, torch.float32)


CALLS = [
    pytest.param(masked_call, id="key_mask"),
    pytest.param(packed_call, id="varlen"),
    pytest.param(options_call, id="score-options"),
]


def forward_backward(function, args, grad_out):
    """(out, dq, dk, dv) of ``function(q, k, v, *rest)`` for ``args = (q, k, v, *rest)``, and
    the gradient of a last argument that requires grad (the sinks) after them."""
    if len(args) > 3 and isinstance(args[-1], torch.Tensor) and args[-1].requires_grad:
        sinks = args[-1].detach().requires_grad_(True)
        leaves = [t.detach().requires_grad_(True) for t in args[:3]]
        out = function(*leaves, *args[3:-1], sinks)
        return (out.detach(),) + torch.autograd.grad(out, leaves + [sinks], grad_out)
    return forward_and_grads(function, args[:3], grad_out, *args[3:])


@pytest.mark.parametrize("make_call", CALLS)
def test_compiled_op_forward_and_backward_match_eager(make_call):
    function, args, grad_out = make_call()
    compiled = torch.compile(function, fullgraph=True)
    expected = forward_backward(function, args, grad_out)
    got = forward_backward(compiled, args, grad_out)
    assert len(got) == len(expected)
    for name, a, b in zip(SINK_RESULT_NAMES, got, expected):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize(
    "make_call,forward,backward",
    [
        pytest.param(masked_call, "attention_forward", "attention_backward", id="key_mask"),
        pytest.param(packed_call, "attention_forward", "attention_backward", id="varlen"),
        pytest.param(
            options_call, "attention_forward", "attention_backward", id="score-options"
        ),
    ],
)
def test_compiled_op_graphs_call_our_forward_and_backward_ops(make_call, forward, backward):
    graphs = {}
    backend = graph_keeping_backend(graphs)
    function, args, grad_out = make_call()
    compiled = torch.compile(function, backend=backend, fullgraph=True)
    got = forward_backward(compiled, args, grad_out)
    expected = forward_backward(function, args, grad_out)
    assert_bitwise_equal(got, expected)  # the same kernels on the same inputs
    targets = {kind: {str(node.target) for node in graph.nodes} for kind, graph in graphs.items()}
    assert f"causal_attention.{forward}.default" in targets["forward"], targets["forward"]
    assert f"causal_attention.{backward}.default" in targets["backward"], targets["backward"]


class MaskedAttention(nn.Module):
    def forward(self, q, k, v, key_mask):
        return masked_attention(q, k, v, key_mask)


class PackedAttention(nn.Module):
    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        return packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k)


class OptionsAttention(nn.Module):
    def forward(self, q, k, v, key_mask, alibi_slopes, sinks):
        return options_attention(q, k, v, key_mask, alibi_slopes, sinks)


@pytest.mark.parametrize(
    "module,make_call,op",
    [
        pytest.param(MaskedAttention, masked_call, "attention", id="key_mask"),
        pytest.param(PackedAttention, packed_call, "varlen_attention", id="varlen"),
        pytest.param(OptionsAttention, options_call, "attention", id="score-options"),
    ],
)
def test_exported_op_matches_eager(module, make_call, op):
    function, args, _ = make_call()
    args = tuple(t.detach() for t in args)
    exported = torch.export.export(module(), args)
    targets = [node.target for node in exported.graph.nodes]
    assert getattr(torch.ops.causal_attention, op).default in targets, targets
    assert torch.equal(exported.module()(*args), function(*args))


def test_exported_key_mask_attention_runs_at_other_shapes():
    batch, len_q, len_k = Dim("batch", max=8), Dim("len_q", max=64), Dim("len_k", max=64)
    _, args, _ = masked_call()
    args = tuple(t.detach() for t in args)
    exported = torch.export.export(
        MaskedAttention(),
        args,
        dynamic_shapes=(
            {0: batch, 2: len_q},
            {0: batch, 2: len_k},
            {0: batch, 2: len_k},
            {0: batch, 1: len_k},
        ),
    )
    for lq, lk, batch in ((3, 20, 2), (30, 7, 5)):
        shape = Case(lq, lk, 8, dv=4, hq=4, hkv=2, batch=(batch,))
        q, k, v = shape.inputs(torch.float32)
        key_mask = make_key_mask(shape.key_mask_shape, "holes")
        expected = masked_attention(q, k, v, key_mask)
        assert torch.equal(exported.module()(q, k, v, key_mask), expected)


def dropout_attention(q, k, v):
    return causal_attention.attention(q, k, v, window=(5, 0), dropout_p=0.3)


def test_compiled_dropout_draws_what_eager_draws():
    """Dropout from the default generator, compiled with fullgraph=True (through AOT autograd,
    without Inductor's own random numbers): in the same generator state the compiled call
    drops what the eager one drops, gradients included, and advances the generator as much."""
    compiled = torch.compile(dropout_attention, backend="aot_eager", fullgraph=True)
    q, k, v = MASKED.inputs(torch.float32, requires_grad=True)
    grad_out = make_tensor(MASKED.out_shape, torch.float32)
    results = []
    for function in (dropout_attention, compiled):
        torch.manual_seed(5)
        results.append(forward_and_grads(function, (q, k, v), grad_out))
        results.append(torch.randint(0, 2**30, (1,)))
    assert_bitwise_equal(results[0], results[2])
    assert torch.equal(results[1], results[3]), "the generators ended in other states"


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return causal_attention.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )


def test_compiled_dynamic_varlen_takes_new_packings_without_recompiling():
    """Each training batch packs other lengths: other totals, cu_seqlens and max_seqlen."""
    compiled = torch.compile(_varlen, fullgraph=True, dynamic=True)
    packings = [PACKED, Packed((7, 3), (7, 30), 8, dv=4, hq=4, hkv=2)]
    packings.append(Packed((1, 1, 1), (5, 6, 9), 8, dv=4, hq=4, hkv=2))
    for i, packed in enumerate(packings):
        q, k, v = packed.inputs(torch.float32, requires_grad=True)
        args = (q, k, v) + packed.lengths_args()
        grad_out = make_tensor(packed.out_shape, torch.float32)
        expected = forward_backward(_varlen, args, grad_out)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = forward_backward(compiled, args, grad_out)
        for name, a, b in zip(RESULT_NAMES, got, expected):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=f"{name} of packing {i}")


def test_exported_varlen_attention_runs_at_other_packings():
    """Dynamic totals and numbers of sequences; max_seqlen_q and max_seqlen_k stay the bounds
    packed_attention passes (MAX_Q, MAX_K), which these packings respect."""
    total_q, total_k = Dim("total_q", max=256), Dim("total_k", max=256)
    entries = Dim("entries", max=33)
    _, args, _ = packed_call()
    args = tuple(t.detach() for t in args)
    exported = torch.export.export(
        PackedAttention(),
        args,
        dynamic_shapes=({0: total_q}, {0: total_k}, {0: total_k}, {0: entries}, {0: entries}),
    )
    for lengths_q, lengths_k in (((7, 3), (7, 12)), ((1,) * 5, (5, 6, 9, 1, 2))):
        packed = Packed(lengths_q, lengths_k, 8, dv=4, hq=4, hkv=2)
        q, k, v = packed.inputs(torch.float32)
        cu_q, cu_k, _, _ = packed.lengths_args()
        expected = packed_attention(q, k, v, cu_q, cu_k)
        assert torch.equal(exported.module()(q, k, v, cu_q, cu_k), expected)


# --- paged_attention on 8-bit caches -----------------------------------------------------------


def eight_bit_decode(q, k_cache, v_cache, block_table, cache_seqlens):
    """Scales per tensor, given as Python floats (constants of the graph)."""
    return causal_attention.paged_attention(q, k_cache, v_cache, block_table, cache_seqlens,
                                            k_scale=0.05, v_scale=0.1, softcap=2.0)


def eight_bit_decode_per_token(q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale):
    return causal_attention.paged_attention(q, k_cache, v_cache, block_table, cache_seqlens,
                                            k_scale=k_scale, v_scale=v_scale, softcap=2.0)


class EightBitDecode(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *tensors):
        return self.function(*tensors)


@pytest.mark.parametrize("layout", ["tensor", "token"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8],
                         ids=["e4m3fn", "e5m2", "int8"])
def test_compiled_and_exported_paged_attention_on_an_eight_bit_cache(dtype, layout):
    q = torch.randn(2, 1, 4, 8, dtype=torch.bfloat16)
    k_cache, v_cache = ((torch.randn(6, 4, 2, 8) * 8).clamp(-100, 100).to(dtype)
                        for _ in range(2))
    args = (q, k_cache, v_cache, torch.tensor([[0, 2], [5, 1]], dtype=torch.int32),
            torch.tensor([5, 8], dtype=torch.int32))
    function = eight_bit_decode
    if layout == "token":
        function = eight_bit_decode_per_token
        args += (torch.rand(6, 4, 2) / 10 + 0.01, torch.rand(6, 4, 2) / 10 + 0.01)
    eager = function(*args)
    assert torch.equal(torch.compile(function, fullgraph=True)(*args), eager)
    exported = torch.export.export(EightBitDecode(function), args)
    targets = [node.target for node in exported.graph.nodes]
    assert torch.ops.causal_attention.paged_attention.default in targets, targets
    assert torch.equal(exported.module()(*args), eager)
