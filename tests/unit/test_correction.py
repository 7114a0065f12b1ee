"""Behaviour-policy corrections (docs/corrections.md): weights and masks against hand-computed
values, exact old-actor anchors, EWMA against a float64 reference, resets, shared anchors across
epochs and minibatches, resume."""

import math

import pytest
import torch

from minippo.models import Transformer, init_weights, qwen3_tiny, token_logprobs
from minippo.parallel.weight_swap import local_shards
from minippo.rl import policy_loss
from minippo.rl.correction import (
    EWMA,
    TIS,
    FixedAnchors,
    KeepOldActor,
    LogLinearProx,
    NoCorrection,
    ProximalAnchors,
    RolloutLogprobs,
    WeightCopies,
    discrepancy_weights,
    loglinear_alpha,
    loglinear_prox_weights,
    symmetric_mask_weights,
    truncated_is_weights,
)
from minippo.rl.types import RolloutBatch
from tests.correction_helpers import model_with, perturb, score

P, R, V = 3, 4, 64
CLASSES = (RolloutLogprobs, TIS, KeepOldActor, EWMA, LogLinearProx, NoCorrection)


def make_model(seed: int = 0) -> Transformer:
    # std 0.5 so that logprobs differ clearly between weight versions
    return init_weights(Transformer(qwen3_tiny(V)), seed=seed, std=0.5)


def weights_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def make_batch(versions: list[list[int]], seed: int = 0) -> RolloutBatch:
    """Rows of R response tokens; -1 in ``versions`` marks padding (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    B = len(versions)
    v = torch.tensor(versions, dtype=torch.int64)
    resp_mask = (v >= 0).float()
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    prompt_mask[0, 0] = False  # one left-padded prompt
    attn = torch.cat([prompt_mask, resp_mask.bool()], dim=1)
    pos = (attn.long().cumsum(1) - 1).clamp(min=0) * attn.long()
    ids = torch.randint(1, V, (B, P + R), generator=g) * attn.long()
    mu = torch.where(resp_mask > 0, -torch.rand(B, R, generator=g) * 3 - 0.5, 0.0)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        position_ids=pos,
        response_mask=resp_mask,
        rollout_logprobs=mu,
        versions=v,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
    )


class ForwardCounter:
    """Counts forward passes through the model (its embedding runs once per pass, whether the
    pass is ``forward`` or ``score``)."""

    def __init__(self, model):
        self.n = 0
        model.tok_embeddings.register_forward_hook(lambda *a: self._hit())

    def _hit(self):
        self.n += 1


# ------------------------------------------------------------------------------------------
# pure weight functions against arithmetic
# ------------------------------------------------------------------------------------------

L2, L3, L05 = math.log(2.0), math.log(3.0), math.log(0.5)


def test_tis_token_truncate_and_mask():
    mu = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    # log ρ = [ln 3, ln 0.5, 0, pad]
    anchor = mu + torch.tensor([[L3, L05, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = truncated_is_weights(anchor, mu, mask, level="token", mode="truncate", low=0.6, cap=2.0)
    torch.testing.assert_close(w.weights, torch.tensor([[2.0, 0.6, 1.0, 0.0]]))
    torch.testing.assert_close(w.keep, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert w.high.tolist() == [[True, False, False, False]]
    assert w.low.tolist() == [[False, True, False, False]]
    w = truncated_is_weights(anchor, mu, mask, level="token", mode="mask", low=0.6, cap=2.0)
    torch.testing.assert_close(w.weights, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(w.keep, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    # boundaries are inside: ρ = cap exactly is kept in mask mode
    w = truncated_is_weights(mu + L2, mu, mask, mode="mask", cap=2.0)
    torch.testing.assert_close(w.weights, torch.tensor([[2.0, 2.0, 2.0, 0.0]]))


def test_tis_sequence_and_geometric_levels():
    mu = torch.zeros(2, 3)
    d = torch.tensor([[L2, L05 / 2, 0.3], [0.1, 0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # sequence: ρ = exp(Σ m d): row 0 exp(ln2 − ln2/2) = √2, row 1 exp(0.3)
    w = truncated_is_weights(mu + d, mu, mask, level="sequence", cap=10.0)
    expected = torch.tensor([[math.sqrt(2)] * 2 + [0.0], [math.exp(0.3)] * 3])
    torch.testing.assert_close(w.weights, expected)
    # geometric: ρ = exp(Σ m d / Σ m): row 0 exp((ln2/2)/2) = 2^(1/4), row 1 exp(0.1)
    w = truncated_is_weights(mu + d, mu, mask, level="geometric", cap=10.0)
    expected = torch.tensor([[2**0.25] * 2 + [0.0], [math.exp(0.1)] * 3])
    torch.testing.assert_close(w.weights, expected)
    # sequence mask mode with cap 1.2: row 0 (√2) rejected whole, row 1 (1.35) too; cap 1.5 keeps 0
    w = truncated_is_weights(mu + d, mu, mask, level="sequence", mode="mask", cap=1.5)
    assert w.keep.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    w = truncated_is_weights(mu + d, mu, mask, level="sequence", mode="mask", cap=1.2)
    assert w.keep.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert w.high.sum() == 5


def test_log_ratio_clamped_and_nonfinite_rejected():
    mu = torch.zeros(2, 2)
    anchor = torch.tensor([[50.0, float("nan")], [0.0, 1.0]])
    mask = torch.ones(2, 2)
    w = truncated_is_weights(anchor, mu, mask, level="token", cap=1e30)
    assert w.weights[0, 0] == pytest.approx(math.exp(20.0), rel=1e-6)  # clamped at +20
    assert w.keep.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert w.nonfinite.tolist() == [[False, True], [False, False]]
    # at sequence level the whole row with a nan is rejected
    w = truncated_is_weights(anchor, mu, mask, level="sequence", cap=1e30)
    assert w.keep.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert int(w.nonfinite.sum()) == 2


def test_discrepancy_and_symmetric_mask_weights():
    mu = torch.zeros(1, 4)
    anchor = torch.tensor([[L3, L05, math.log(0.4), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = discrepancy_weights(anchor, mu, mask, cap=2.0)  # clamp(ρ, 0, 2)
    torch.testing.assert_close(w.weights, torch.tensor([[2.0, 0.5, 0.4, 0.0]]))
    assert w.keep.tolist() == [[1.0, 1.0, 1.0, 0.0]]
    w = discrepancy_weights(anchor, mu, mask, cap=None)
    torch.testing.assert_close(w.weights, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    w = symmetric_mask_weights(anchor, mu, mask, cap=2.0)  # keep ρ ∈ [0.5, 2]
    torch.testing.assert_close(w.weights, torch.tensor([[0.0, 0.5, 0.0, 0.0]]))
    assert w.keep.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert w.high.tolist() == [[True, False, False, False]]
    assert w.low.tolist() == [[False, False, True, False]]


def test_loglinear_alpha_and_weights():
    versions = torch.tensor([[5, 4, 3, 1, -1]])
    mask = (versions >= 0).float()
    alpha = loglinear_alpha(versions, mask, step=5)
    # α = clamp((v_k − 1 − v_t)/(v_k − v_t), 0, 1): lag 0 → 0, 1 → 0, 2 → 1/2, 4 → 3/4, pad → 0
    torch.testing.assert_close(alpha, torch.tensor([[0.0, 0.0, 0.5, 0.75, 0.0]]))
    mu = torch.tensor([[-1.0, -1.0, -2.0, -3.0, 0.0]])
    lp = torch.tensor([[-0.5, -0.5, -1.0, -1.0, -7.0]])
    anchor, w = loglinear_prox_weights(lp, mu, alpha, mask, cap=1.5)
    # a = μ + α(lp − μ): [-1, -1, -1.5, -3 + 0.75·2 = -1.5, 0 (pad)]
    torch.testing.assert_close(anchor, torch.tensor([[-1.0, -1.0, -1.5, -1.5, 0.0]]))
    # w = min(exp(a − μ), 1.5): [1, 1, e^0.5 = 1.6487 → 1.5, e^1.5 → 1.5, 0]
    torch.testing.assert_close(w.weights, torch.tensor([[1.0, 1.0, 1.5, 1.5, 0.0]]))
    assert w.high.tolist() == [[False, False, True, True, False]]


# ------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------


def test_metrics_hand_computed():
    batch = make_batch([[0, 0, 0, -1], [1, 1, -1, -1]])
    mu = batch.rollout_logprobs
    d = torch.tensor([[L3, L05, 0.0, 0.0], [0.2, -0.1, 0.0, 0.0]])

    def fixed_score(model, b):
        return mu + d

    tis = dict(level="token", mode="mask", low=0.6, cap=2.0)
    corr = TIS(**tis, updates_per_step=2, score_fn=fixed_score)  # two updates: a scoring pass
    out = corr.prepare(batch, torch.nn.Linear(1, 1), step=2)
    m = out.metrics()
    # one update per step: the training forward's logprobs are the anchor, no scoring pass;
    # the same tokens give the same metrics
    current = TIS(**tis, score_fn=fixed_score).prepare(batch, torch.nn.Linear(1, 1), step=2)
    assert current.minibatch(slice(0, 1), (mu + d)[:1]).anchor_logprobs[0, 3] == 0
    current.minibatch(slice(1, 2), (mu + d)[1:])
    m_current = current.metrics()
    assert m_current.pop("correction/forward_passes") == 0
    assert m_current == pytest.approx({k: v for k, v in m.items() if "forward" not in k})
    # 5 tokens: ρ = 3 (masked high), 0.5 (masked low), 1, e^0.2, e^-0.1 kept
    kept_w = [1.0, math.exp(0.2), math.exp(-0.1)]
    assert m["correction/tokens"] == 5
    assert m["correction/retained_fraction"] == pytest.approx(3 / 5)
    assert m["correction/is_weight_mean"] == pytest.approx(sum(kept_w) / 3)
    assert m["correction/is_weight_max"] == pytest.approx(math.exp(0.2))
    assert m["correction/is_weight_min"] == pytest.approx(math.exp(-0.1))
    assert m["correction/frac_masked_high"] == pytest.approx(1 / 5)
    assert m["correction/frac_masked_low"] == pytest.approx(1 / 5)
    assert not any(k.startswith("correction/frac_truncated") for k in m)  # mask mode: masked
    absd = [L3, -L05, 0.0, 0.2, 0.1]
    assert m["correction/abs_diff_mean"] == pytest.approx(sum(absd) / 5, rel=1e-5)
    assert m["correction/abs_diff_max"] == pytest.approx(L3, rel=1e-6)
    k3 = [
        (r - 1) - math.log(r) for r in (3.0, 0.5, 1.0, math.exp(0.2), math.exp(-0.1))
    ]  # KL(μ‖π_anchor) k3: (ρ − 1) − log ρ
    assert m["correction/kl_k3"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    # staleness = step − v over the 5 tokens: 2, 2, 2, 1, 1
    assert m["correction/staleness_min"] == 1
    assert m["correction/staleness_max"] == 2
    assert m["correction/staleness_mean"] == pytest.approx(8 / 5)
    assert m["correction/forward_passes"] == 1
    # anchors are 0 on padding
    assert out.anchor_logprobs[0, 3] == 0 and out.anchor_logprobs[1, 2:].eq(0).all()


def test_versions_newer_than_step_refused():
    batch = make_batch([[3, 3, 3, 3]])
    with pytest.raises(ValueError, match=r"versions must lie in \[0, step=2\]"):
        RolloutLogprobs().prepare(batch, torch.nn.Linear(1, 1), step=2)


# ------------------------------------------------------------------------------------------
# simple methods
# ------------------------------------------------------------------------------------------


def test_rollout_logprobs_no_forward_and_anchor_is_mu():
    model = make_model()
    counter = ForwardCounter(model)
    batch = make_batch([[0, 0, 1, -1], [1, 1, 1, 1]])
    out = RolloutLogprobs().prepare(batch, model, step=1)
    assert counter.n == 0 and out.metrics()["correction/forward_passes"] == 0
    assert torch.equal(out.anchor_logprobs, batch.rollout_logprobs)
    assert torch.equal(out.weights, batch.response_mask)
    assert torch.equal(out.keep_mask, batch.response_mask)


def test_rollout_logprobs_rejects_non_finite_mu_and_keeps_it_out_of_the_metrics():
    batch = make_batch([[0, 0, 0, -1], [1, 1, 1, 1]])
    batch.rollout_logprobs[0, 1] = float("-inf")
    batch.rollout_logprobs[1, 2] = float("nan")
    out = RolloutLogprobs().prepare(batch, make_model(), step=1)
    expected_keep = batch.response_mask.clone()
    expected_keep[0, 1] = expected_keep[1, 2] = 0.0
    assert torch.equal(out.keep_mask, expected_keep) and torch.equal(out.weights, expected_keep)
    assert torch.isfinite(out.anchor_logprobs).all()
    assert out.metrics()["correction/frac_nonfinite"] == 2 / 7  # 2 of the 7 response tokens
    assert out.metrics()["correction/abs_diff_mean"] == 0.0  # a = μ on every finite token


@pytest.mark.parametrize("cls", [NoCorrection, TIS])
def test_current_weight_anchor_methods_score_once(cls):
    model = make_model()
    counter = ForwardCounter(model)
    batch = make_batch([[0, 0, 1, -1], [1, 1, 1, 1]])
    out = cls(temperature=0.7, updates_per_step=2).prepare(batch, model, step=1)
    assert counter.n == 1
    expected = score(model, batch, temperature=0.7) * batch.response_mask
    assert torch.equal(out.anchor_logprobs, expected)


@pytest.mark.parametrize(
    "level,mode",
    [("token", "truncate"), ("token", "mask"), ("sequence", "truncate"), ("geometric", "mask")],
)
def test_tis_one_update_anchors_the_training_forward(level, mode):
    """With one optimizer update per step the anchor is the step-start weights, which is what
    the training forward runs at: ``tis`` takes its detached logprobs instead of scoring the batch
    first. Given the same logprobs, anchors, weights and keep-mask equal the scoring pass's."""
    model = make_model()
    counter = ForwardCounter(model)
    batch = make_batch([[0, 0, 1, -1], [1, 1, 1, 1], [0, 1, -1, -1]])
    g = torch.Generator().manual_seed(3)
    noise = 0.05 * torch.randn(batch.response_mask.shape, generator=g)
    lp = score(model, batch, temperature=0.7)
    batch.rollout_logprobs = torch.where(batch.response_mask > 0, lp + noise, 0.0)
    counter.n = 0
    opts = dict(temperature=0.7, level=level, mode=mode, low=0.97, cap=1.03)
    out = TIS(**opts).prepare(batch, model, step=1)
    assert counter.n == 0 and out.metrics()["correction/forward_passes"] == 0
    want = TIS(**opts, updates_per_step=2).prepare(batch, model, step=1)
    rows = torch.tensor([2, 0])
    got = out.minibatch(rows, lp[rows].requires_grad_())
    ref = want.minibatch(rows)
    for name in ("anchor_logprobs", "weights", "keep_mask"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=0, atol=0)
    assert not got.anchor_logprobs.requires_grad
    valid = batch.response_mask[rows] > 0
    assert (ref.keep_mask[valid] > 0).any() and (ref.weights[valid] != 1).any()  # weights bind
    if mode == "mask" and level == "token":
        assert (ref.keep_mask[valid] == 0).any()
    # token by token (the fused loss's chunks) only for token-level weights
    anchors = out.token_anchors(rows)
    assert (anchors is None) == (level != "token")
    if anchors is not None:
        flat = lp[rows].reshape(-1)
        parts = [anchors(flat[i : i + 3], slice(i, i + 3)) for i in range(0, flat.numel(), 3)]
        for j, name in enumerate(("anchor_logprobs", "weights", "keep_mask")):
            chunked = torch.cat([p[j] for p in parts]).view_as(lp[rows])
            torch.testing.assert_close(chunked, getattr(ref, name), rtol=0, atol=0)


def test_greedy_temperature_scores_at_one():
    model = make_model()
    batch = make_batch([[0, 0, 0, 0]])
    out = NoCorrection(temperature=0.0).prepare(batch, model, step=0)
    assert torch.equal(out.anchor_logprobs, score(model, batch, temperature=1.0))


# ------------------------------------------------------------------------------------------
# keep_old_actor
# ------------------------------------------------------------------------------------------


def _three_versions():
    """Actor that published versions 0, 1, 2 (weights w0, w1, w2) and then trained further."""
    model = make_model()
    corr = KeepOldActor(max_staleness=2)
    saved = []
    for v in range(3):
        saved.append(weights_of(model))
        corr.on_weights_published(v, model)
        perturb(model, seed=10 + v)
    return model, corr, saved


def test_keep_old_actor_exact_per_token_versions():
    model, corr, saved = _three_versions()
    current = weights_of(model)
    counter = ForwardCounter(model)
    # row 1 spans versions 0 → 1 (a partial rollout), row 2 spans 1 → 2
    batch = make_batch([[0, 0, 0, -1], [0, 0, 1, 1], [1, 2, 2, 2], [2, 2, -1, -1]])
    out = corr.prepare(batch, model, step=2)
    assert counter.n == 3
    assert out.metrics()["correction/version_mismatches"] == 0
    assert out.metrics()["correction/versions_in_batch"] == 3
    refs = [score(model_with(w), batch) for w in saved]
    for b in range(4):
        for j in range(R):
            v = int(batch.versions[b, j])
            expected = refs[v][b, j] if v >= 0 else torch.tensor(0.0)
            # bit for bit: the anchor comes from the forward of the token's own version
            assert torch.equal(out.anchor_logprobs[b, j], expected), (b, j, v)
    # the actor's weights are restored exactly
    for p, w in zip(model.parameters(), current):
        assert torch.equal(p, w)
    rho = torch.exp(out.anchor_logprobs - batch.rollout_logprobs).clamp(max=2.0)
    torch.testing.assert_close(out.weights, rho * batch.response_mask)


def test_keep_old_actor_bytes_and_eviction():
    model, corr, _ = _three_versions()
    numel = sum(p.numel() for p in model.parameters())
    assert corr.live_versions == [0, 1, 2]
    assert corr.snapshot_bytes == 3 * numel * 4  # numel × element size per live version
    corr.retain([1])  # version 2 is the latest published: always kept
    assert corr.live_versions == [1, 2]
    assert corr.snapshot_bytes == 2 * numel * 4
    with pytest.raises(
        ValueError, match=r"versions \[0\] are still referenced but have no snapshot"
    ):
        corr.retain([0, 2])
    corr.release_versions_below(2)
    assert corr.live_versions == [2]
    corr.on_weights_published(3, model)
    corr.retain([])
    assert corr.live_versions == [3]
    with pytest.raises(ValueError, match="older than the last published version 3"):
        corr.on_weights_published(2, model)
    # re-publishing the latest version (e.g. after a resume) overwrites it in place
    perturb(model, seed=99)
    corr.on_weights_published(3, model)
    assert corr.live_versions == [3] and corr.snapshot_bytes == numel * 4
    snap = corr.state_dict()["snapshots"][3]
    assert all(torch.equal(a, p) for a, p in zip(snap, model.parameters()))


def test_keep_old_actor_reuses_the_evicted_versions_buffers_for_the_next_snapshot():
    model = make_model()
    corr = KeepOldActor(max_staleness=1)
    corr.on_weights_published(0, model)
    old = corr.state_dict()["snapshots"][0]
    perturb(model, seed=1)
    corr.on_weights_published(1, model)
    corr.retain([])  # evicts version 0: its buffers become the spare
    assert corr.live_versions == [1]
    perturb(model, seed=2)
    corr.on_weights_published(2, model)  # takes the spare: no new allocation
    new = corr.state_dict()["snapshots"][2]
    assert [t.data_ptr() for t in new] == [t.data_ptr() for t in old]
    assert all(torch.equal(a, p) for a, p in zip(new, model.parameters()))  # the new weights
    assert corr.live_versions == [1, 2]  # version 1 is untouched
    assert not any(torch.equal(a, b) for a, b in zip(new, corr.state_dict()["snapshots"][1]))


def test_keep_old_actor_accelerator_storage_keeps_snapshots_on_the_parameter_device():
    model = make_model()
    corr = KeepOldActor(storage="accelerator")
    corr.on_weights_published(0, model)
    w0 = weights_of(model)
    perturb(model, seed=1)
    batch = make_batch([[0, 0, 0, 0]])
    out = corr.prepare(batch, model, step=0)
    assert all(t.device == p.device for t, p in zip(corr.state_dict()["snapshots"][0], w0))
    assert torch.equal(out.anchor_logprobs, score(model_with(w0), batch))


def test_keep_old_actor_prepare_releases_versions_out_of_the_staleness_window():
    model, corr, _ = _three_versions()  # max_staleness = 2
    out = corr.prepare(make_batch([[0, 1, 2, 2]]), model, step=2)
    # another step may still train from version 2 (sync_every > 1): all of 0..2 are needed
    assert corr.live_versions == [0, 1, 2]
    assert out.metrics()["correction/snapshot_versions"] == 3
    perturb(model, seed=9)
    corr.on_weights_published(3, model)  # steps train from version 3 on: v >= 3 − 2 = 1
    assert corr.live_versions == [1, 2, 3]


def test_keep_old_actor_missing_version_is_an_error_and_restores_weights():
    model, corr, _ = _three_versions()
    corr.retain([1])
    current = weights_of(model)
    batch = make_batch([[0, 1, 1, 1]])
    with pytest.raises(
        RuntimeError, match=r"1 tokens .* no anchor from a snapshot of their own version"
    ):
        corr.prepare(batch, model, step=2)
    for p, w in zip(model.parameters(), current):
        assert torch.equal(p, w)


def test_keep_old_actor_bf16_storage():
    model = make_model()
    w0 = weights_of(model)
    corr = KeepOldActor(storage_dtype="bf16", cap=None)
    corr.on_weights_published(0, model)
    perturb(model, seed=3)
    numel = sum(p.numel() for p in model.parameters())
    assert corr.snapshot_bytes == numel * 2
    batch = make_batch([[0, 0, 0, 0]])
    out = corr.prepare(batch, model, step=0)
    ref = score(model_with([w.bfloat16().float() for w in w0]), batch)
    assert torch.equal(out.anchor_logprobs, ref)
    assert torch.equal(out.weights, batch.response_mask)  # cap=None: w = 1


def test_keep_old_actor_resume_is_identical():
    model, corr, _ = _three_versions()
    state = corr.state_dict()
    resumed = KeepOldActor(max_staleness=2)
    resumed.load_state_dict(state)
    assert resumed.live_versions == corr.live_versions
    batch = make_batch([[0, 0, 1, 1], [2, 2, 2, -1]])
    a = corr.prepare(batch, model, step=2)
    b = resumed.prepare(batch, model, step=2)
    assert torch.equal(a.anchor_logprobs, b.anchor_logprobs)
    assert torch.equal(a.weights, b.weights)
    with pytest.raises(ValueError, match="method 'keep_old_actor'"):
        EWMA().load_state_dict(state)


# ------------------------------------------------------------------------------------------
# ewma
# ------------------------------------------------------------------------------------------


def test_ewma_beta_from_staleness_window():
    # s = max_staleness × updates_per_step / 2 = 2 × 8 / 2 = 8 → β = 8/9; mean age β/(1−β) = 8
    assert EWMA(max_staleness=2, updates_per_step=8).beta == pytest.approx(8 / 9)
    assert EWMA(max_staleness=0, updates_per_step=8).beta == 0.0
    assert EWMA(max_staleness=2, updates_per_step=8, beta=0.5).beta == 0.5


def test_ewma_matches_float64_reference():
    model = make_model()
    corr = EWMA(max_staleness=1, updates_per_step=4)  # s = 2, β = 2/3
    beta = corr.beta
    corr.on_weights_published(0, model)
    ref = [p.detach().double().clone() for p in model.parameters()]
    n = 1.0
    for k in range(7):
        perturb(model, seed=100 + k)
        corr.after_optimizer_step(model)
        n_prev, n = n, beta * n + 1  # n ← β·n + 1
        for rb, p in zip(ref, model.parameters()):
            rb.mul_(beta * n_prev / n).add_(p.detach().double() / n)  # θ̄·(β·n_prev/n) + θ/n
    assert corr.n == pytest.approx(n, rel=1e-15)
    for tb, rb in zip(corr.theta_bar, ref):
        assert tb.dtype == torch.float32
        torch.testing.assert_close(tb.double(), rb, rtol=0, atol=1e-6)
    # anchors come from θ̄ and the actor is restored
    current = weights_of(model)
    batch = make_batch([[0, 1, 1, 1]])
    expected = score(model_with([t.clone() for t in corr.theta_bar]), batch)
    batch.rollout_logprobs = expected - 0.1  # ρ = e^0.1 everywhere: all kept, no reset
    out = corr.prepare(batch, model, step=1)
    assert out.metrics()["correction/ewma_resets"] == 0
    assert torch.equal(out.anchor_logprobs, expected)
    torch.testing.assert_close(out.weights, torch.full_like(expected, math.exp(0.1)))
    for p, w in zip(model.parameters(), current):
        assert torch.equal(p, w)
    dist_ref = math.sqrt(
        sum(float((t.double() - w.double()).pow(2).sum()) for t, w in zip(corr.theta_bar, current))
    )
    assert out.metrics()["correction/ewma_distance"] == pytest.approx(dist_ref, rel=1e-5)


def test_ewma_distance_equals_the_per_tensor_sum_bit_for_bit(monkeypatch):
    """The grouped foreach distance adds the same float64 terms in the same order as a loop of
    ‖θ̄_i − θ_i‖² per tensor, whatever the group size."""
    import minippo.rl.correction.ewma as ewma_mod

    model = make_model()
    corr = EWMA(max_staleness=1, updates_per_step=4)
    corr.on_weights_published(0, model)
    for k in range(3):
        perturb(model, seed=200 + k)
        corr.after_optimizer_step(model)
    perturb(model, seed=300)
    expected = 0.0
    for tb, t in zip(corr.theta_bar, model.parameters()):
        d2 = torch.linalg.vector_norm(tb - t.detach().float()).double() ** 2
        expected += d2.item()
    assert expected > 0
    for group_numel in (64 * 2**20, 1000, 1):  # one group, several, one tensor per group
        monkeypatch.setattr(ewma_mod, "_DISTANCE_GROUP_NUMEL", group_numel)
        assert corr.distance(model) == math.sqrt(expected)


def test_ewma_bf16_parameters_keep_an_fp32_average():
    layer = torch.nn.Linear(3, 2).to(torch.bfloat16)
    corr = EWMA(beta=0.5)
    corr.on_weights_published(0, layer)
    ref = [p.detach().double() for p in layer.parameters()]
    n = 1.0
    for k in range(4):
        perturb(layer, seed=k)
        corr.after_optimizer_step(layer)
        n_prev, n = n, 0.5 * n + 1
        ref = [
            r * (0.5 * n_prev / n) + p.detach().double() / n
            for r, p in zip(ref, layer.parameters())
        ]
    for tb, r in zip(corr.theta_bar, ref):
        assert tb.dtype == torch.float32
        torch.testing.assert_close(tb.double(), r, rtol=0, atol=1e-6)


def test_ewma_synchronous_beta_zero_tracks_current_weights():
    model = make_model()
    corr = EWMA(max_staleness=0)
    corr.on_weights_published(0, model)
    perturb(model, seed=1)
    corr.after_optimizer_step(model)
    assert corr.n == 1.0
    for tb, p in zip(corr.theta_bar, model.parameters()):
        assert torch.equal(tb, p.detach())


def _batch_scored_by(model, versions, offset=0.0):
    batch = make_batch(versions)
    lp = score(model, batch)
    batch.rollout_logprobs = torch.where(batch.response_mask > 0, lp + offset, 0.0)
    return batch


def test_ewma_reset_recomputes_anchors_with_reset_theta_bar():
    model = make_model()
    corr = EWMA(max_staleness=2, updates_per_step=1, reset_below=0.8)
    corr.on_weights_published(0, model)
    for k in range(3):
        perturb(model, seed=200 + k, scale=1.0)  # large steps: θ̄ drifts far from θ
        corr.after_optimizer_step(model)
    # the engine sampled with the current weights: μ = log π_θ, so only θ̄'s drift separates them
    batch = _batch_scored_by(model, [[2, 2, 2, 2], [2, 2, 2, -1]])
    counter = ForwardCounter(model)
    out = corr.prepare(batch, model, step=2)
    m = out.metrics()
    assert m["correction/ewma_retained_before_reset"] < 0.8
    assert m["correction/ewma_reset_this_step"] == 1 and m["correction/ewma_resets"] == 1
    assert corr.n == 1.0 and m["correction/ewma_distance"] == 0.0
    for tb, p in zip(corr.theta_bar, model.parameters()):
        assert torch.equal(tb, p.detach())
    assert counter.n == 2  # θ̄ forward + the recomputation with the reset θ̄
    # recomputed anchors: the reset θ̄ is the current actor, which also produced μ
    assert torch.equal(out.anchor_logprobs, batch.rollout_logprobs)
    assert m["correction/retained_fraction"] == 1.0
    torch.testing.assert_close(out.weights, batch.response_mask)


def test_ewma_no_reset_when_retained():
    model = make_model()
    corr = EWMA(max_staleness=2, updates_per_step=1)
    corr.on_weights_published(0, model)
    perturb(model, seed=5, scale=1e-4)
    corr.after_optimizer_step(model)
    out = corr.prepare(_batch_scored_by(model, [[1, 1, 1, 1]]), model, step=1)
    assert out.metrics()["correction/ewma_resets"] == 0
    assert out.metrics()["correction/retained_fraction"] == 1.0


def _ewma_prepare(swap_storage: str, device: str = "cpu"):
    model = make_model().to(device)
    corr = EWMA(max_staleness=2, updates_per_step=1, swap_storage=swap_storage)
    corr.on_weights_published(0, model)
    for k in range(2):
        perturb(model, seed=300 + k)
        corr.after_optimizer_step(model)
    current = weights_of(model)
    batch = make_batch([[1, 1, 1, 1], [0, 1, 1, -1]])
    out = corr.prepare(batch.to(device), model, step=2)
    for p, w in zip(model.parameters(), current):  # the actor's own weights are back
        assert torch.equal(p, w)
    return corr, out


def test_ewma_swap_buffer_on_host_gives_the_same_anchors():
    corr_dev, out_dev = _ewma_prepare("accelerator")
    corr_cpu, out_cpu = _ewma_prepare("cpu")
    assert torch.equal(out_cpu.anchor_logprobs, out_dev.anchor_logprobs)
    assert corr_cpu._swap.device == torch.device("cpu") and corr_dev._swap.device is None
    assert all(t.device.type == "cpu" for t in corr_cpu._swap._saved)
    assert (
        out_cpu.metrics()["correction/swap_buffer_bytes"]
        == (out_dev.metrics()["correction/swap_buffer_bytes"])
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ewma_swap_buffer_on_host_with_cuda_parameters():
    corr, out = _ewma_prepare("cpu", device="cuda")
    assert all(t.device.type == "cpu" and t.is_pinned() for t in corr._swap._saved)
    assert all(t.device.type == "cuda" for t in corr.theta_bar)
    _, ref = _ewma_prepare("accelerator", device="cuda")
    assert torch.equal(out.anchor_logprobs, ref.anchor_logprobs)


def test_ewma_after_step_before_init_is_an_error():
    with pytest.raises(RuntimeError, match="not initialised"):
        EWMA().after_optimizer_step(make_model())


def test_ewma_resume_is_identical():
    model = make_model()
    corr = EWMA(max_staleness=2, updates_per_step=2)
    corr.on_weights_published(0, model)
    for k in range(3):
        perturb(model, seed=300 + k)
        corr.after_optimizer_step(model)
    corr.resets = 2
    resumed = EWMA(max_staleness=2, updates_per_step=2)
    resumed.load_state_dict(corr.state_dict())
    assert (resumed.n, resumed.resets) == (corr.n, corr.resets)
    for k in range(3):
        perturb(model, seed=400 + k)
        corr.after_optimizer_step(model)
        resumed.after_optimizer_step(model)
    for a, b in zip(corr.theta_bar, resumed.theta_bar):
        assert torch.equal(a, b)
    batch = make_batch([[2, 2, 1, 1]])
    assert torch.equal(
        corr.prepare(batch, model, step=2).anchor_logprobs,
        resumed.prepare(batch, model, step=2).anchor_logprobs,
    )
    with pytest.raises(ValueError, match=r"beta=0\.5"):
        EWMA(beta=0.5).load_state_dict(corr.state_dict())


# ------------------------------------------------------------------------------------------
# one anchor per step, shared by every epoch and minibatch
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_anchors_shared_by_every_epoch_and_minibatch(cls):
    torch.manual_seed(0)
    model = make_model()
    corr = cls(max_staleness=2, updates_per_step=8)
    corr.on_weights_published(0, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for v in (1, 2):
        perturb(model, seed=7 + v)
        corr.on_weights_published(v, model)
    versions = [[0, 0, 1, 2], [1, 1, 2, -1], [0, 2, 2, 2], [2, 2, -1, -1]]
    batch = _batch_scored_by(model, versions)
    out = corr.prepare(batch, model, step=2)
    if isinstance(out, ProximalAnchors):  # α and μ are fixed for the step, not the anchor
        frozen = {"alpha": out.alpha.clone(), "mu": out.rollout_logprobs.clone()}
    else:
        assert isinstance(out, FixedAnchors)
        frozen = {"anchor": out.anchor_logprobs.clone()}
    adv = torch.randn(4, R)
    used = {}  # (epoch, minibatch) -> anchors used
    for epoch in range(2):
        for mb in range(4):
            rows = torch.tensor([mb])
            sub = batch.select(rows)
            logp = token_logprobs(
                model,
                sub.input_ids,
                attention_mask=sub.attention_mask,
                position_ids=sub.position_ids,
                start=sub.prompt_len,
            )
            c = out.minibatch(rows, logp)
            used[(epoch, mb)] = c.anchor_logprobs.clone()
            loss, _ = policy_loss(
                logp,
                c.anchor_logprobs,
                adv[rows],
                sub.response_mask,
                weights=c.weights,
                keep_mask=c.keep_mask,
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            corr.after_optimizer_step(model)
    if isinstance(out, ProximalAnchors):
        # α and μ are fixed for the step; the anchor follows the current policy by definition
        assert cls is LogLinearProx
        assert torch.equal(out.alpha, frozen["alpha"]) and torch.equal(
            out.rollout_logprobs, frozen["mu"]
        )
        assert not torch.equal(used[(0, 0)], used[(1, 0)])
        # the weight metrics are computed when asked: over every minibatch call (2 epochs)
        assert out.metrics()["correction/tokens"] == 2 * float(batch.response_mask.sum())
    else:
        assert torch.equal(out.anchor_logprobs, frozen["anchor"])
        for mb in range(4):  # the last epoch's minibatch used the same bits as the first's
            assert torch.equal(used[(1, mb)], used[(0, mb)])
            assert torch.equal(used[(0, mb)], frozen["anchor"][mb : mb + 1])


def test_loglinear_prox_minibatch_needs_policy_logprobs():
    batch = make_batch([[0, 1, 1, 1]])
    out = LogLinearProx().prepare(batch, torch.nn.Linear(1, 1), step=1)
    with pytest.raises(ValueError, match="minibatch needs its logprobs"):
        out.minibatch(slice(0, 1))


def test_local_shards_share_storage():
    model = make_model()
    shards = local_shards(model)
    shards[0].zero_()
    assert next(model.parameters()).abs().sum() == 0


def test_ewma_reset_guard_keeps_theta_bar_when_the_actor_retains_less():
    """The reset trap: θ̄ is closer to stale data than the current actor. The seed's rule resets
    anyway (retention falls further); reset_guard=True keeps θ̄ and counts the refusal."""
    old = make_model()
    # the data was sampled by the old weights (μ = log π_old); θ̄ = old weights exactly (n = 1)
    # μ = log π_old + 1 on 4 of the 7 tokens (ρ_θ̄ = e^-1 < 1/2: masked): θ̄ retains 3/7 < 0.8
    offset = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    batch = _batch_scored_by(old, [[1, 1, 1, 1], [1, 1, 1, -1]], offset=offset)
    results = {}
    for guard in (False, True):
        model = make_model()
        corr = EWMA(max_staleness=2, updates_per_step=1, reset_below=0.8, reset_guard=guard)
        corr.on_weights_published(0, model)  # θ̄ ← the old weights
        perturb(model, seed=7, scale=1.0)  # the actor moved far from the data
        out = corr.prepare(batch, model, step=2)
        results[guard] = (corr, out.metrics())
    seed_rule, guarded = results[False], results[True]
    assert guarded[1]["correction/ewma_retained_before_reset"] == pytest.approx(3 / 7)
    # the actor, which the seed's rule resets θ̄ to, retains less of this batch than θ̄ did
    assert seed_rule[1]["correction/retained_fraction"] < 3 / 7
    assert seed_rule[1]["correction/ewma_reset_this_step"] == 1 and seed_rule[0].resets == 1
    assert guarded[1]["correction/ewma_reset_this_step"] == 0 and guarded[0].resets == 0
    assert guarded[1]["correction/ewma_resets_refused"] == 1
    # the guarded run keeps θ̄ (the old weights) and its 3/7
    assert guarded[1]["correction/retained_fraction"] == pytest.approx(3 / 7)
    for tb, p in zip(guarded[0].theta_bar, old.parameters()):
        assert torch.equal(tb, p.detach())


def test_ewma_reset_guard_still_resets_when_the_actor_is_closer():
    model = make_model()
    corr = EWMA(max_staleness=2, updates_per_step=1, reset_below=0.8, reset_guard=True)
    corr.on_weights_published(0, model)
    for k in range(3):
        perturb(model, seed=200 + k, scale=1.0)
        corr.after_optimizer_step(model)
    out = corr.prepare(_batch_scored_by(model, [[2, 2, 2, 2]]), model, step=2)  # μ = the actor
    m = out.metrics()
    assert m["correction/ewma_reset_this_step"] == 1 and m["correction/ewma_resets_refused"] == 0
    assert m["correction/retained_fraction"] == 1.0


def test_bf16_theta_bar_tracks_the_fp32_average_over_1000_updates():
    """θ̄ in bf16 (stochastic rounding of fp32 lerps) against θ̄ in fp32, same actor trajectory.

    Bound from the arithmetic: each update adds a zero-mean rounding error r with |r| < 1 ulp and
    Var r ≤ ulp²/4 and shrinks the old error by (1 − 1/n) → β, so the error is stationary with
    Var ≤ ulp²/(4(1 − β²)). With β = 2/3 (max_staleness 1, 4 updates a step) the std is ≤ 0.68 ulp:
    we allow 6 std per element (≈ 4.1 ulp; a false alarm below 1e-8 per element) and, for the
    mean over the N elements (which would show a bias, e.g. a stall), 6 std / √N. The ulp is that
    of max(|θ̄|, 2^-7): the errors still alive (weight β^k > 1e-7: the last 40 updates) were made
    at values within a 40-step random walk of 1e-3 steps (≈ 6e-3 < 2^-7) of today's, so near 0
    they were made at that spacing, not at the tiny spacing of a value that just crossed 0.
    """
    model = make_model()
    ref = EWMA(max_staleness=1, updates_per_step=4)
    low = EWMA(max_staleness=1, updates_per_step=4, theta_dtype="bf16")
    assert low.beta == pytest.approx(2 / 3)
    ref.on_weights_published(0, model)
    low.on_weights_published(0, model)
    for k in range(1000):
        perturb(model, seed=k, scale=1e-3)  # small steps: most updates are below bf16's ulp
        ref.after_optimizer_step(model)
        low.after_optimizer_step(model)
    assert all(t.dtype == torch.bfloat16 for t in low.theta_bar)
    errs = []
    for a, b in zip(low.theta_bar, ref.theta_bar):
        ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=2**-7))) - 7)  # bf16 spacing
        errs.append(((a.float() - b) / ulp).flatten())
    e = torch.cat(errs)
    std = (1 / (4 * (1 - (2 / 3) ** 2))) ** 0.5
    assert e.abs().max() <= 6 * std, float(e.abs().max())
    assert e.mean().abs() <= 6 * std / e.numel() ** 0.5, float(e.mean())


def test_bf16_rounding_to_nearest_would_stall_stochastic_rounding_does_not():
    from minippo.rl.correction.ewma import lerp_stochastic_bf16_

    dst = torch.ones(100_000, dtype=torch.bfloat16)
    target = torch.full((100_000,), 1.0 + 2**-7 / 4)  # a quarter of bf16's ulp at 1.0 above it
    nearest = dst.float().lerp(target, 0.5).to(torch.bfloat16)
    assert torch.equal(nearest, dst)  # round-to-nearest never moves
    lerp_stochastic_bf16_(dst, target, 0.5, seed=0)
    # the expected value is 1 + ulp/8: an ulp with probability 1/8 (binomial, 6 std bound)
    frac = float((dst > 1).float().mean())
    assert abs(frac - 1 / 8) <= 6 * (1 / 8 * 7 / 8 / 100_000) ** 0.5


def test_keep_old_actor_needs_no_swap_buffer_when_the_actor_holds_the_latest_version():
    """The recipe's order: publish v, prepare (before any update). The latest version is scored in
    place and the actor is restored from its snapshot: no swap buffer, anchors still exact."""
    model = make_model()
    corr = KeepOldActor(max_staleness=1)
    corr.on_weights_published(0, model)
    w0 = weights_of(model)
    perturb(model, seed=3)  # the updates of step 0
    corr.on_weights_published(1, model)  # version 1: the actor holds it at the start of step 1
    w1 = weights_of(model)
    batch = make_batch([[0, 0, 1, 1], [1, 1, 1, -1]])
    counter = ForwardCounter(model)
    out = corr.prepare(batch, model, step=1)
    m = out.metrics()
    assert m["correction/swap_buffer_bytes"] == 0 and counter.n == 2
    expected = torch.where(
        batch.versions == 0, score(model_with(w0), batch), score(model_with(w1), batch)
    )
    expected = torch.where(batch.response_mask > 0, expected, 0.0)
    assert torch.equal(out.anchor_logprobs, expected)
    for p, w in zip(model.parameters(), w1):  # restored from the snapshot of version 1
        assert torch.equal(p, w)
    assert KeepOldActor.stored_weights(max_staleness=1, partial_rollout=False) == [
        WeightCopies("snapshots", 2, None, "cpu")
    ]
