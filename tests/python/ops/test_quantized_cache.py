"""causal_attention.attention on 8-bit K/V (a KV cache kept in float8_e4m3fn, float8_e5m2 or
int8, ``(B, Hkv, Lk, D)``), read in place by paged_attention as one page per batch item: for
every 8-bit dtype, scale layout (per tensor, per token and KV head) and q dtype, decode rows and
a chunk of 64 queries are as close to the float64 reference on the dequantized K/V as the usual
rule for q's dtype asks, GQA and every score option paged_attention takes (window, softcap,
ALiBi, sinks); strided K/V are read as they lie; the rest (masks, dropout, gradients, bad
scales) is refused with typed errors naming the argument."""

import math

import pytest
import torch

import causal_attention as ca
from attention_testing.quantized import (
    EIGHT_BIT,
    EIGHT_BIT_IDS,
    Q_DTYPE_IDS,
    Q_DTYPES,
    assert_matches_dequantized,
    random_eight_bit,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LAYOUTS = ["tensor", "token"]


def kv_cache(dtype, layout, batch=2, hkv=2, lk=150, d=32, dv=16):
    """8-bit K and V (B, Hkv, Lk, D|Dv), their scales (a float or float32 (B, Hkv, Lk)) and
    their dequantized float64 values."""
    k, k_scale, k64 = random_eight_bit((batch, hkv, lk, d), dtype, layout)
    v, v_scale, v64 = random_eight_bit((batch, hkv, lk, dv), dtype, layout)
    return k, v, k_scale, v_scale, k64, v64


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=Q_DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
@pytest.mark.parametrize("lq", [1, 64], ids=["decode", "chunk64"])
def test_matches_float64_on_the_dequantized_kv(lq, dtype, layout, q_dtype):
    """GQA (8 query heads on 2 KV heads); the chunk's rows are the last 64 of the 150 keys."""
    k, v, k_scale, v_scale, k64, v64 = kv_cache(dtype, layout)
    q = torch.randn(2, 8, lq, 32).to(q_dtype)
    out = ca.attention(q, k, v, k_scale=k_scale, v_scale=v_scale)
    assert out.shape == (2, 8, lq, 16) and out.dtype == q_dtype
    assert_matches_dequantized(out, q, k64, v64, 32 ** -0.5)


OPTIONS = {
    "window": dict(window=(20, 0)),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes=torch.tensor([0.02, 0.01, 0.005, 0.0025])),
    "alibi-per-batch": dict(alibi_slopes=torch.rand(2, 4) * 0.02),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    "all": dict(window=(30, 0), softcap=3.0, alibi_slopes=torch.tensor([0.02, 0.01, 0.0, 0.03]),
                sinks=torch.tensor([1.0, 0.0, -2.0, 0.5]), scale=0.2),
}


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("lq", [1, 64], ids=["decode", "chunk64"])
def test_score_options(lq, option, dtype, q_dtype):
    k, v, k_scale, v_scale, k64, v64 = kv_cache(dtype, "token", hkv=1, lk=100)
    q = torch.randn(2, 4, lq, 32).to(q_dtype)
    options = dict(OPTIONS[option])
    scale = options.pop("scale", 32 ** -0.5)
    out = ca.attention(q, k, v, scale=scale, k_scale=k_scale, v_scale=v_scale, **options)
    assert_matches_dequantized(out, q, k64, v64, scale, **options)


def test_one_element_tensor_scales_and_default_scales():
    k, v, k_scale, v_scale, k64, v64 = kv_cache(torch.int8, "tensor")
    q = torch.randn(2, 8, 3, 32)
    as_floats = ca.attention(q, k, v, k_scale=k_scale, v_scale=v_scale)
    as_tensors = ca.attention(q, k, v, k_scale=torch.tensor(k_scale),
                              v_scale=torch.tensor([v_scale], dtype=torch.float64))
    assert torch.equal(as_floats, as_tensors)
    # Without scales the stored values are the keys and values (scale 1).
    unscaled = ca.attention(q, k, v)
    assert_matches_dequantized(unscaled, q, k.double(), v.double(), 32 ** -0.5)


def test_kv_are_read_where_they_lie():
    """A cache kept (B, Lk, Hkv, D) and viewed (B, Hkv, Lk, D), and per-token scales kept
    (B, Lk, Hkv), give the contiguous K/V's result bit for bit."""
    k, v, k_scale, v_scale, _, _ = kv_cache(torch.float8_e4m3fn, "token")
    q = torch.randn(2, 8, 5, 32, dtype=torch.bfloat16)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v, k_scale, v_scale)]
    assert not strided[0].is_contiguous()
    expected = ca.attention(q, k, v, k_scale=k_scale, v_scale=v_scale)
    got = ca.attention(q, strided[0], strided[1], k_scale=strided[2], v_scale=strided[3])
    assert torch.equal(got, expected)


def test_the_cache_is_not_written_and_no_key_gives_zeros():
    k, v, k_scale, v_scale, _, _ = kv_cache(torch.int8, "token")
    before = (k.clone(), v.clone(), k_scale.clone(), v_scale.clone())
    ca.attention(torch.randn(2, 8, 1, 32), k, v, k_scale=k_scale, v_scale=v_scale)
    assert all(torch.equal(a, b) for a, b in zip((k, v, k_scale, v_scale), before))
    empty = torch.zeros(2, 2, 0, 32, dtype=torch.int8)
    out = ca.attention(torch.randn(2, 8, 3, 32), empty, empty[..., :16])
    assert out.shape == (2, 8, 3, 16) and torch.count_nonzero(out) == 0


def test_queries_requiring_grad_are_refused_but_served_under_no_grad():
    k, v, k_scale, v_scale, _, _ = kv_cache(torch.float8_e5m2, "tensor")
    q = torch.randn(2, 8, 1, 32, requires_grad=True)
    with pytest.raises(NotImplementedError, match="inference only.*q requires grad"):
        ca.attention(q, k, v, k_scale=k_scale, v_scale=v_scale)
    sinks = torch.zeros(8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="sinks requires grad"):
        ca.attention(q.detach(), k, v, sinks=sinks)
    with torch.no_grad():
        out = ca.attention(q, k, v, k_scale=k_scale, v_scale=v_scale)
    assert not out.requires_grad


def bad_call(**changes):
    """attention on int8 K/V (2, 2, 6, 8) with per-token scales, ``changes`` applied."""
    args = dict(q=torch.randn(2, 4, 2, 8), k=torch.randint(-127, 128, (2, 2, 6, 8),
                                                          dtype=torch.int8),
                v=torch.randint(-127, 128, (2, 2, 6, 8), dtype=torch.int8),
                k_scale=torch.full((2, 2, 6), 0.01), v_scale=0.02)
    args.update(changes)
    return lambda: ca.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def scales_with(value, at=(1, 0, 5)):
    scales = torch.full((2, 2, 6), 0.01)
    scales[at] = value
    return scales


BAD = [
    pytest.param(bad_call(k_scale=torch.ones(2, 6, 2)), ValueError,
                 r"k_scale must be one scale per tensor .* \(B, Hkv, Lk\) = \(2, 2, 6\), got "
                 r"k_scale.shape=\(2, 6, 2\)", id="k_scale-shape"),
    pytest.param(bad_call(v_scale=torch.ones(2)), ValueError, r"v_scale.*v_scale.shape=\(2,\)",
                 id="v_scale-two-elements"),
    pytest.param(bad_call(k_scale=torch.ones(2, 2, 6, dtype=torch.float64)), TypeError,
                 "k_scale .* must be float32, got k_scale.dtype=torch.float64",
                 id="k_scale-float64-per-token"),
    pytest.param(bad_call(v_scale=torch.tensor(2)), TypeError,
                 "v_scale .* must be floating, got v_scale.dtype=torch.int64", id="v_scale-int"),
    pytest.param(bad_call(k_scale="0.1"), TypeError, "k_scale must be a float", id="k_scale-str"),
    pytest.param(bad_call(k_scale=True), TypeError, "k_scale must be a float",
                 id="k_scale-bool"),
    pytest.param(bad_call(v_scale=0.0), ValueError,
                 "v_scale must be positive and finite .*got v_scale=0.0", id="v_scale-zero"),
    pytest.param(bad_call(v_scale=-0.5), ValueError, "v_scale must be positive and finite",
                 id="v_scale-negative"),
    pytest.param(bad_call(v_scale=torch.tensor(math.inf)), ValueError,
                 "v_scale must be positive and finite", id="v_scale-inf-tensor"),
    pytest.param(bad_call(v_scale=1e39), ValueError, r"v_scale must be positive and finite \(in "
                 "float32\\)", id="v_scale-inf-in-float32"),
    pytest.param(bad_call(k_scale=scales_with(0.0)), ValueError,
                 r"k_scale must be positive and finite, got k_scale\[1\]\[0\]\[5\]=0.0",
                 id="k_scale-token-zero"),
    pytest.param(bad_call(k_scale=scales_with(-1.0, (0, 1, 2))), ValueError,
                 r"k_scale\[0\]\[1\]\[2\]=-1.0", id="k_scale-token-negative"),
    pytest.param(bad_call(k_scale=scales_with(math.nan)), ValueError,
                 r"k_scale\[1\]\[0\]\[5\]=nan", id="k_scale-token-nan"),
    pytest.param(bad_call(k_scale=scales_with(math.inf)), ValueError,
                 r"k_scale\[1\]\[0\]\[5\]=inf", id="k_scale-token-inf"),
    pytest.param(bad_call(k_scale=torch.tensor(0.5, requires_grad=True)), NotImplementedError,
                 "k_scale .*requires grad", id="k_scale-requires-grad"),
    pytest.param(bad_call(k=torch.randn(2, 2, 6, 8)), TypeError,
                 "8-bit k and v must share one dtype", id="k-float-v-int8"),
    pytest.param(bad_call(v=torch.zeros(2, 2, 6, 8, dtype=torch.float8_e4m3fn)), TypeError,
                 "k.dtype=torch.int8, v.dtype=torch.float8_e4m3fn", id="int8-k-fp8-v"),
    pytest.param(bad_call(k=torch.randn(2, 2, 6, 8), v=torch.randn(2, 2, 6, 8)), ValueError,
                 "k_scale dequantizes 8-bit k and v", id="scale-with-float-kv"),
    pytest.param(bad_call(q=torch.randn(2, 4, 2, 8, dtype=torch.float64)), TypeError,
                 "q must be float32, bfloat16 or float16 beside torch.int8 k and v",
                 id="q-float64"),
    pytest.param(bad_call(q=torch.randn(4, 2, 8)), ValueError,
                 r"must be \(B, Hq, Lq, D\).*q.shape=\(4, 2, 8\)", id="q-3d"),
    pytest.param(bad_call(q=torch.randn(2, 3, 2, 8)), ValueError, "multiple", id="heads"),
    pytest.param(bad_call(q=torch.randn(3, 4, 2, 8)), ValueError, r"q.shape=\(3, 4, 2, 8\)",
                 id="batch"),
    pytest.param(bad_call(key_mask=torch.ones(2, 6, dtype=torch.bool)), NotImplementedError,
                 "key_mask with 8-bit k and v is not supported", id="key_mask"),
    pytest.param(bad_call(attn_mask=torch.ones(2, 6, dtype=torch.bool)), NotImplementedError,
                 "attn_mask with 8-bit k and v is not supported", id="attn_mask"),
    pytest.param(bad_call(dropout_p=0.1), NotImplementedError,
                 "dropout_p with 8-bit k and v is not supported", id="dropout"),
    pytest.param(bad_call(window=5), TypeError, "window must be two ints", id="window-int"),
]


@pytest.mark.parametrize("call,error,match", BAD)
def test_bad_calls_raise_typed_errors_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match) as raised:
        call()
    assert str(raised.value).startswith("causal_attention.attention: ")


def test_float_kv_without_scales_still_go_to_the_op():
    """K/V that are not 8-bit (or only one of them 8-bit, without scales) are the op's: its
    autograd and its dtype errors."""
    q, k, v = (torch.randn(2, 2, 4, 8, requires_grad=True) for _ in range(3))
    ca.attention(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is not None
    with pytest.raises(TypeError, match="k.dtype=Float8_e4m3fn"):
        ca.attention(q, k.detach().to(torch.float8_e4m3fn), v)
