"""Tests for nanoengine.layers.sampler (chapter 06): greedy exactness, top-k/top-p sets, statistics, seeds."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoengine.layers.sampler import (Sampler, SamplingBatch, apply_top_k_top_p, draw_exponentials, mix_seed,
                                       splitmix64)
from nanoengine.sampling_params import SamplingParams as SP

NEG_INF = float("-inf")


def batch_of(params, positions=None):
    return SamplingBatch.from_params(params, positions if positions is not None else [0] * len(params))


def chi_square_p_value(counts: torch.Tensor, q: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against the distribution `q` (over q > 0)."""
    allowed = q > 0
    expected = counts.sum() * q[allowed]
    stat = ((counts[allowed] - expected) ** 2 / expected).sum()
    dof = int(allowed.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


# --- seeds ------------------------------------------------------------------------------------------------------

def test_splitmix64_reference_value_and_mix_seed_range():
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert all(0 <= mix_seed(s, p) < 2**63 for s in (0, 1, 2**63 - 1) for p in (0, 1, 10**9))
    assert len({mix_seed(s, p) for s in range(30) for p in range(100)}) == 3000
    assert len({mix_seed(3, p) & 0xFFFFFFFF for p in range(2000)}) == 2000


# --- SamplingBatch ------------------------------------------------------------------------------------------------

def test_from_params_fields_and_flags():
    b = batch_of([SP(temperature=0.0, top_k=5, top_p=0.5, seed=1), SP(temperature=0.7, top_k=9),
                  SP(top_p=0.8, seed=4)], [2, 3, 11])
    assert b.num_rows == 3
    assert b.temperatures.dtype == torch.float32 and b.top_ks.dtype == torch.int64 and b.top_ps.dtype == torch.float32
    assert b.top_ks.tolist() == [-1, 9, -1] and b.max_top_k == 9
    assert torch.allclose(b.top_ps, torch.tensor([1.0, 1.0, 0.8]))
    assert b.seeds == [None, None, mix_seed(4, 11)]
    assert (b.all_greedy, b.any_top_k, b.any_top_p, b.any_seeded) == (False, True, True, True)
    plain = batch_of([SP(), SP(temperature=0.3)])
    assert (plain.all_greedy, plain.any_top_k, plain.any_top_p, plain.any_seeded) == (False, False, False, False)
    assert batch_of([SP(temperature=0.0, seed=3)] * 2).all_greedy


@pytest.mark.parametrize("params, positions, error", [
    ([SP()], [0, 1], ValueError),
    ([SP()], [-1], ValueError),
    ([SP()], [0.5], TypeError),
    ([object()], [0], TypeError),
])
def test_from_params_rejects_bad_input(params, positions, error):
    with pytest.raises(error):
        SamplingBatch.from_params(params, positions)


# --- Sampler: shapes and greedy -----------------------------------------------------------------------------------

def test_shape_validation():
    sampler, b = Sampler(), batch_of([SP()] * 3)
    for bad in (torch.randn(3), torch.randn(2, 10), torch.randn(1, 3, 10), torch.randn(3, 0)):
        with pytest.raises(ValueError):
            sampler(bad, b)


def test_empty_batch():
    assert Sampler()(torch.randn(0, 7), batch_of([])).shape == (0,)


def test_one_pass_is_a_checked_flag_and_a_cpu_takes_chapter_06s_path_either_way():
    assert Sampler().one_pass and not Sampler(one_pass=False).one_pass
    with pytest.raises(TypeError, match="one_pass"):
        Sampler(one_pass="no")
    logits, batch = torch.randn(8, 300), batch_of([SP(temperature=0.7)] * 8)
    torch.manual_seed(3)
    first = Sampler(one_pass=False)(logits, batch)
    torch.manual_seed(3)
    assert torch.equal(first, Sampler()(logits, batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_equal_argmax_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 500, generator=g) * 4).to(dtype)
    logits[5, [7, 300]] = logits[5].max() + 1                       # tie: the first index wins, as in torch.argmax
    greedy = [SP(temperature=0.0)] * 64
    assert torch.equal(Sampler()(logits, batch_of(greedy)), logits.argmax(-1))
    mixed = [SP(temperature=0.0) if i % 2 else SP(temperature=5.0, top_p=0.99, seed=i) for i in range(64)]
    out = Sampler()(logits, batch_of(mixed))
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])
    assert Sampler()(logits, batch_of(greedy))[5] == 7


def test_input_logits_are_not_modified():
    logits = torch.randn(4, 50)
    before = logits.clone()
    Sampler()(logits, batch_of([SP(top_k=3), SP(top_p=0.5), SP(temperature=0.5), SP(seed=1)]))
    assert torch.equal(logits, before)


def test_tiny_temperature_is_greedy():
    logits = torch.randn(500, 40, generator=torch.Generator().manual_seed(11))
    top2 = logits.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.01                   # gap / T > 100: the runner-up has p < e^-100
    out = Sampler()(logits, batch_of([SP(temperature=1e-4)] * 500))
    assert clear.sum() > 450 and torch.equal(out[clear], logits.argmax(-1)[clear])


# --- statistics -------------------------------------------------------------------------------------------------

def reference_probs(z: torch.Tensor, sp: SP) -> torch.Tensor:
    """Target distribution in float64: temperature, top-k, then top-p on the renormalised result (ties kept)."""
    z = z.double()
    p = torch.softmax(z / sp.temperature, -1)
    if sp.top_k > 0:
        kth = z.sort(descending=True).values[min(sp.top_k, len(z)) - 1]
        p = torch.where(z >= kth, p, 0.0)
        p = p / p.sum()
    if sp.top_p < 1:
        ranked = p.sort(descending=True).values
        num_kept = int(((torch.cumsum(ranked, 0) - ranked) < sp.top_p).sum())
        p = torch.where(p >= ranked[num_kept - 1], p, 0.0)
        p = p / p.sum()
    return p


@pytest.mark.parametrize("sp", [SP(), SP(temperature=0.5), SP(temperature=2.0), SP(top_k=3), SP(top_p=0.6),
                                SP(temperature=1.4, top_k=4, top_p=0.75)], ids=str)
def test_frequencies_match_target_distribution(sp):
    torch.manual_seed(1234)
    z = torch.tensor([1.8, 1.2, 1.0, 0.3, -0.2, -1.0])
    n = 100_000
    tokens = Sampler()(z.expand(n, -1), batch_of([sp] * n))
    counts = torch.bincount(tokens, minlength=len(z)).double()
    q = reference_probs(z, sp)
    assert counts[q == 0].sum() == 0
    assert chi_square_p_value(counts, q) > 1e-4
    assert torch.allclose(counts / n, q, atol=0.01)


def test_seeded_rows_over_many_positions_match_distribution():
    z = torch.tensor([1.0, 0.5, 0.0, -0.5])
    n = 40_000
    tokens = Sampler()(z.expand(n, -1), batch_of([SP(seed=99)] * n, list(range(n))))
    counts = torch.bincount(tokens, minlength=4).double()
    assert chi_square_p_value(counts, reference_probs(z, SP())) > 1e-4


def test_ties_at_a_threshold_are_kept():
    z = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    for sp, expected in [(SP(top_k=1), [False, True, True, False, True]),
                         (SP(top_k=4), [False, True, True, True, True]),
                         (SP(top_p=0.2), [False, True, True, False, True]),
                         (SP(top_k=2, top_p=0.1), [False, True, True, False, True])]:
        assert (apply_top_k_top_p(z.clone(), batch_of([sp])) > NEG_INF)[0].tolist() == expected, sp


def test_top_token_alone_exceeding_top_p_is_always_chosen():
    z = torch.tensor([6.0, 1.0, 0.0, -1.0])               # p(top) ~ 0.99
    tokens = Sampler()(z.expand(20_000, -1), batch_of([SP(top_p=0.5, temperature=1.0)] * 20_000))
    assert (tokens == 0).all()


# --- top-k / top-p sets (property-based) -------------------------------------------------------------------------

logit_rows = st.lists(st.sampled_from([-3.0, -1.0, -0.5, 0.0, 0.25, 1.0, 2.0, 4.0]) | st.floats(-8, 8, width=32),
                      min_size=1, max_size=24)
top_k_values = st.sampled_from([-1, 1, 2, 3, 5, 50])
top_p_values = st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.2, 0.01]) | st.floats(0.01, 1.0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(rows=st.lists(st.tuples(logit_rows, top_k_values, top_p_values, st.floats(0.1, 3.0)), min_size=1, max_size=5),
       vocab=st.integers(1, 24))
def test_masks_and_samples_stay_in_the_allowed_set(rows, vocab):
    logits = torch.tensor([(r[0] * vocab)[:vocab] for r in rows], dtype=torch.float32)          # [B, vocab]
    params = [SP(temperature=t, top_k=k, top_p=p) for _, k, p, t in rows]
    b = batch_of(params)
    scaled = logits / b.temperatures.unsqueeze(1)
    masked = apply_top_k_top_p(scaled.clone(), b)
    kept = masked > NEG_INF
    for i, sp in enumerate(params):
        z = scaled[i]
        assert kept[i, z.argmax()]                                                   # the top token survives
        if sp.top_k > 0:                                                             # never outside the k largest
            kth = z.sort(descending=True).values[min(sp.top_k, vocab) - 1]
            assert not (kept[i] & (z < kth)).any()
            if sp.top_p == 1.0:
                assert torch.equal(kept[i], z >= kth)
        if sp.top_p < 1.0:                                       # nucleus: enough mass, minimal up to ties, a prefix
            base = torch.where(z >= (z.sort(descending=True).values[min(sp.top_k, vocab) - 1]
                                     if sp.top_k > 0 else NEG_INF), z, NEG_INF)
            p = torch.softmax(base.double(), -1)
            smallest_kept = z[kept[i]].min()
            assert p[kept[i]].sum().item() >= sp.top_p - 1e-5
            assert p[z > smallest_kept].sum().item() < sp.top_p + 1e-5
            assert not (~kept[i] & (z >= smallest_kept)).any()
        if sp.top_k < 0 and sp.top_p == 1.0:
            assert kept[i].all()
    tokens = Sampler()(logits.repeat(20, 1), batch_of(params * 20))
    assert kept.repeat(20, 1).gather(1, tokens.unsqueeze(1)).all()


# --- seeds: reproducibility ---------------------------------------------------------------------------------------

def test_seeded_row_reproduces_across_batch_compositions_and_rng_state():
    g = torch.Generator().manual_seed(5)
    row = torch.randn(1, 2000, generator=g) * 2
    sp = SP(temperature=0.9, top_k=200, top_p=0.95, seed=31337)
    alone = [Sampler()(row, batch_of([sp], [pos])).item() for pos in range(30)]
    for pos in range(30):
        others = [SP(temperature=0.0), SP(top_p=0.3), SP(seed=pos, top_k=4), SP(temperature=2.0)][: pos % 4 + 1]
        logits = torch.cat([torch.randn(len(others), 2000, generator=g), row])[torch.randperm(len(others) + 1,
                                                                                            generator=g)]
        where = int((logits == row).all(-1).nonzero())
        params = list(others)
        params.insert(where, sp)
        positions = [pos + 100] * len(others)
        positions.insert(where, pos)
        torch.manual_seed(pos)                                                       # disturb the global generator
        assert Sampler()(logits, batch_of(params, positions))[where].item() == alone[pos]
    assert len(set(alone)) > 5


def test_seeded_noise_depends_only_on_seed_and_position():
    like = torch.empty(3, 300)
    a = draw_exponentials(like, batch_of([SP(seed=8), SP(), SP(seed=9)], [4, 4, 4]))
    b = draw_exponentials(like[:1], batch_of([SP(seed=8)], [4]))
    c = draw_exponentials(like[:1], batch_of([SP(seed=8)], [5]))
    assert torch.equal(a[0], b[0]) and not torch.equal(b[0], c[0]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and math.isclose(a.mean().item(), 1.0, abs_tol=0.1)


def test_unseeded_rows_follow_the_global_generator():
    logits = torch.randn(8, 100)
    b = batch_of([SP()] * 8)
    torch.manual_seed(3)
    first = Sampler()(logits, b)
    torch.manual_seed(3)
    assert torch.equal(Sampler()(logits, b), first)


@pytest.mark.parametrize("temperature", [1e-44, 1e-46, 1e-30, 9.99e-6])
def test_temperatures_below_the_threshold_are_greedy_without_nan(temperature):
    """Issue 16: 1e-44 used to give NaN logits (token 0 forever), 1e-46 float32 zero (sampling at T=1)."""
    from nanoengine.sampling_params import MIN_TEMPERATURE
    assert temperature < MIN_TEMPERATURE and SP(temperature=temperature).greedy
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1)) * 4
    batch = batch_of([SP(temperature=temperature), SP(temperature=temperature, seed=3), SP(top_k=5)] + [SP()] * 5)
    tokens = Sampler()(logits, batch)
    assert torch.equal(tokens[:2], logits.argmax(-1)[:2])
