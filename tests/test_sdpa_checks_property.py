"""Property tests of the SDPA argument checks (hypothesis, CPU): ``check_sdpa`` accepts exactly the shapes torch's
scaled_dot_product_attention semantics allow (as this library states them: equal leading axes, Hq a multiple of Hkv
with enable_gqa, masks broadcastable to (..., Hq, L, S)), and every refusal names the argument it is about.

Arrays are zero-stride NumPy views (``np.broadcast_to``), so a case costs the checks alone.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cupy_attn.attention import checks

dims = st.integers(min_value=1, max_value=4)


def _array(shape, dtype=np.float32):
    return np.broadcast_to(np.zeros((), dtype), shape)


def _check(q, k, v, mask=None, enable_gqa=False):
    return checks.check_sdpa(_array(q), _array(k), _array(v), None if mask is None else _array(mask, bool), 0.0,
                             False, None, enable_gqa, "auto")


@st.composite
def valid_problems(draw):
    lead = tuple(draw(st.lists(dims, min_size=0, max_size=2)))
    hkv, groups = draw(dims), draw(dims)
    L, S, E, Ev = draw(dims), draw(dims), draw(dims), draw(dims)
    hq = hkv * groups
    return lead + (hq, L, E), lead + (hkv, S, E), lead + (hkv, S, Ev), groups > 1


@settings(max_examples=200, deadline=None)
@given(valid_problems())
def test_valid_shapes_are_accepted_and_described(problem):
    q, k, v, gqa = problem
    p = _check(q, k, v, enable_gqa=gqa)
    assert (p.num_heads, p.seqlen_q, p.head_dim) == q[-3:]
    assert (p.num_kv_heads, p.seqlen_k, p.head_dim_v) == (k[-3], k[-2], v[-1])
    assert p.batch_shape == q[:-2] and p.batch == int(np.prod(q[:-3]))
    if p.num_heads != p.num_kv_heads:  # GQA shapes are refused without the flag, naming the heads axis
        with pytest.raises(ValueError, match=r"key heads \(axis -3\)"):
            _check(q, k, v, enable_gqa=False)


# (argument, axis) that a perturbation changes, and the argument the error must name
_PERTURB = [("key", -1, "key"), ("value", -2, "value"), ("value", -3, "value"), ("key", 0, "key")]


@settings(max_examples=200, deadline=None)
@given(valid_problems(), st.sampled_from(_PERTURB), st.integers(min_value=1, max_value=3))
def test_one_wrong_axis_is_refused_naming_the_argument(problem, perturb, delta):
    q, k, v, gqa = problem
    name, axis, named = perturb
    shapes = {"query": list(q), "key": list(k), "value": list(v)}
    if axis == 0 and len(q) == 3:  # no leading axis to disagree on: give key and value one query lacks
        shapes["key"], shapes["value"] = [2] + shapes["key"], [2] + shapes["value"]
        match = "same number of axes"
    else:
        shapes[name][axis] += delta
        match = named
    with pytest.raises(ValueError, match=match):
        _check(*(tuple(shapes[n]) for n in ("query", "key", "value")), enable_gqa=gqa)


@st.composite
def problems_with_masks(draw):
    q, k, v, gqa = draw(valid_problems())
    target = q[:-2] + (q[-2], k[-2])
    ndim = draw(st.integers(min_value=0, max_value=len(target) + 1))
    mask = []
    for i in range(ndim):
        want = target[len(target) - ndim + i] if ndim <= len(target) else None
        mask.append(draw(st.sampled_from([1, want] if want is not None else [1, 2])
                         | st.integers(min_value=1, max_value=5)))
    return q, k, v, gqa, tuple(mask), target


@settings(max_examples=300, deadline=None)
@given(problems_with_masks())
def test_mask_accepted_iff_broadcastable_to_the_scores(case):
    q, k, v, gqa, mask, target = case
    try:
        broadcastable = len(mask) <= len(target) and np.broadcast_shapes(mask, target) == target
    except ValueError:
        broadcastable = False
    if broadcastable:
        p = _check(q, k, v, mask, enable_gqa=gqa)
        assert p.mask_kind == "bool" and p.mask.shape == mask
    else:
        with pytest.raises(ValueError, match="attn_mask"):
            _check(q, k, v, mask, enable_gqa=gqa)


def test_masks_agree_with_torch():
    """The broadcast rule above is torch's for masks of two or more axes: torch's CPU SDPA runs exactly the masks
    check_sdpa accepts (a few cases, torch being slower than the checks). One known difference: a 1-D mask (S,) is
    accepted here (NumPy broadcasting) while torch 2.13 raises IndexError for it."""
    torch = pytest.importorskip("torch")
    q, k, v = (2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 5)
    for mask in [(4, 6), (4, 1), (1, 6), (3, 1, 6), (2, 1, 1, 1), (4, 5), (2, 4, 6), (3, 4, 1), (2, 3, 4, 6),
                 (1, 3, 1, 6), (3, 3, 4, 6)]:
        try:
            _check(q, k, v, mask)
            ours = True
        except ValueError as e:
            assert "attn_mask" in str(e)
            ours = False
        try:
            torch.nn.functional.scaled_dot_product_attention(torch.zeros(q), torch.zeros(k), torch.zeros(v),
                                                             attn_mask=torch.ones(mask, dtype=torch.bool))
            theirs = True
        except RuntimeError:
            theirs = False
        assert ours == theirs, (mask, ours, theirs)
