"""Each algorithm's loss against a value worked out by hand on tiny tensors, and its planning rules.

Convention in every case: ``old_logp = 0`` unless said otherwise, so ``logp = log(ratio)``.
Shared batch: ratios r = [[1.5, 0.9], [0.7, -]], mask = [[1, 1], [1, 0]], advantages A = [1, -1].
"""

from __future__ import annotations

import math

import pytest
import torch

from services.contracts.config import AlgorithmConfig, ConfigError, parse_config
from services.contracts.messages import Sample
from services.training.algorithms import ALGORITHMS, load_algorithm_class, make_algorithm, make_inputs
from services.training.algorithms.base import kl_estimate
from tests.helpers import make_sample

MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])


def ratios(r: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(r)).requires_grad_(True)


def inputs(cfg: AlgorithmConfig, logp: torch.Tensor, old: torch.Tensor | None = None, mask: torch.Tensor = MASK,
           adv: torch.Tensor = ADV, **kw):  # type: ignore[no-untyped-def]
    old = torch.zeros_like(logp) if old is None else old
    return make_inputs(cfg, logp, old, mask, adv, torch.zeros(len(adv), dtype=torch.bool), **kw)


def loss_of(name: str, x, **cfg):  # type: ignore[no-untyped-def]
    loss, stats = make_algorithm(AlgorithmConfig(name=name, **cfg)).loss(x)
    return loss.detach(), stats


def test_grpo_clipped_token_mean() -> None:
    # row 0 (A=1):  r=1.5 -> max(-1.5, -1.2) = -1.2 ; r=0.9 -> max(-0.9, -0.9) = -0.9
    # row 1 (A=-1): r=0.7 -> max(0.7, 0.8) = 0.8 ; masked token ignored
    # token mean = (-1.2 - 0.9 + 0.8) / 3 = -0.433333 ; clipped: 1.5 and 0.7 -> 2/3
    cfg = AlgorithmConfig(name="grpo")
    loss, stats = loss_of("grpo", inputs(cfg, ratios([[1.5, 0.9], [0.7, 1.0]])))
    assert float(loss) == pytest.approx(-1.3 / 3, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3) and stats["pg_loss"] == pytest.approx(-1.3 / 3, abs=1e-6)


def test_grpo_and_dr_grpo_advantages() -> None:
    s = [make_sample(g, r, tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0])
         for g, r in [("a", 1.0), ("a", 0.0), ("b", 3.0), ("b", 3.0)]]
    # group a: mean 0.5, std 0.5 -> GRPO (+1, -1); Dr.GRPO no std -> (+0.5, -0.5); group b: all equal -> 0
    grpo = make_algorithm(AlgorithmConfig(name="grpo")).advantages(s)
    dr = make_algorithm(AlgorithmConfig(name="dr_grpo")).advantages(s)
    torch.testing.assert_close(grpo, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_dr_grpo_sums_tokens_over_a_constant() -> None:
    # same per-token losses (-1.2, -0.9, 0.8): sum -1.3; / (2 rows x 2 padded positions) = -0.325
    # with norm_tokens = 4: -1.3 / (2 x 4) = -0.1625
    cfg = AlgorithmConfig(name="dr_grpo")
    x = inputs(cfg, ratios([[1.5, 0.9], [0.7, 1.0]]))
    assert float(loss_of("dr_grpo", x)[0]) == pytest.approx(-0.325, abs=1e-6)
    assert float(loss_of("dr_grpo", x, norm_tokens=4)[0]) == pytest.approx(-0.1625, abs=1e-6)


def test_ppo_dual_clip() -> None:
    # row 1 now r=5 with A=-1: max(-A r, -A clip(r)) = max(5, 1.2) = 5; dual clip c=3: min(5, 3) = 3
    # token mean = (-1.2 - 0.9 + 3) / 3 = 0.3; the dual clip bit on 1 of 3 tokens
    cfg = AlgorithmConfig(name="ppo", dual_clip_c=3.0)
    loss, stats = loss_of("ppo", inputs(cfg, ratios([[1.5, 0.9], [5.0, 1.0]])), dual_clip_c=3.0)
    assert float(loss) == pytest.approx(0.3, abs=1e-6)
    assert stats["dual_clip_frac"] == pytest.approx(1 / 3)
    # GRPO (no dual clip) on the same tensors: (-1.2 - 0.9 + 5) / 3
    assert float(loss_of("grpo", inputs(cfg, ratios([[1.5, 0.9], [5.0, 1.0]])))[0]) == pytest.approx(2.9 / 3)


def test_gspo_sequence_ratio() -> None:
    # row 0: log ratios (ln 1.21, ln 1) -> mean ln 1.1 -> s = 1.1 (inside the clip) -> -A s = -1.1
    # row 1: one token ln 0.64 -> s = 0.64 -> max(0.64, clip 0.8) = 0.8
    # mean over rows = (-1.1 + 0.8) / 2 = -0.15 ; row 1 clipped -> clip_frac 1/2
    cfg = AlgorithmConfig(name="gspo")
    loss, stats = loss_of("gspo", inputs(cfg, ratios([[1.21, 1.0], [0.64, 3.0]])))
    assert float(loss) == pytest.approx(-0.15, abs=1e-6)
    assert stats["clip_frac"] == 0.5


def test_cispo_value_and_gradient() -> None:
    # logp = [[-1, -2], [-0.5, -]], ratios (1.5, 0.9, 0.7) -> clipped weights (1.2, 0.9, 0.8), no grad through them
    # per token -w A logp: -1.2*1*(-1) = 1.2 ; -0.9*1*(-2) = 1.8 ; -0.8*(-1)*(-0.5) = -0.4 ; mean 2.6/3
    # d loss / d logp = -w A / 3 = (-0.4, -0.3, +0.8/3)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([[1.5, 0.9], [0.7, 1.0]]))
    cfg = AlgorithmConfig(name="cispo")
    loss, _ = make_algorithm(cfg).loss(inputs(cfg, logp, old))
    assert float(loss.detach()) == pytest.approx(2.6 / 3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.4, -0.3], [0.8 / 3, 0.0]]))


def test_reinforce_pp_advantages() -> None:
    s = [make_sample(g, r, tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0])
         for g, r in [("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 0.0)]]
    # no baseline: batch mean 0.25, population std sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(0.1875) = 0.4330127
    plain = make_algorithm(AlgorithmConfig(name="reinforce_pp")).advantages(s)
    torch.testing.assert_close(plain, torch.tensor([0.75, -0.25, -0.25, -0.25]) / 0.4330127, atol=1e-5, rtol=0)
    # baseline: group-centred (0.5, -0.5, 0, 0), batch std sqrt(0.5 / 4) = 0.3535534
    base = make_algorithm(AlgorithmConfig(name="reinforce_pp_baseline")).advantages(s)
    torch.testing.assert_close(base, torch.tensor([0.5, -0.5, 0.0, 0.0]) / 0.3535534, atol=1e-5, rtol=0)


def test_sft_negative_log_likelihood() -> None:
    # nll over masked tokens: (1 + 2 + 0.5) / 3
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    loss, stats = loss_of("sft", inputs(AlgorithmConfig(name="sft"), logp))
    assert float(loss) == pytest.approx(3.5 / 3) and stats["nll"] == pytest.approx(3.5 / 3)


def test_dpo_loss() -> None:
    # rows: chosen, rejected. pi_c = -1 - 2 = -3, ref_c = -4 ; pi_r = -0.5, ref_r = -1 (second token masked)
    # margin = beta ((-3 + 4) - (-0.5 + 1)) = 0.1 * 0.5 = 0.05 ; loss = -log sigmoid(0.05) = log(1 + e^-0.05)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -2.0], [-1.0, -1.0]])
    loss, stats = loss_of("dpo", inputs(AlgorithmConfig(name="dpo"), logp, ref_logp=ref), dpo_beta=0.1)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-0.05)), abs=1e-6)
    assert stats["dpo_accuracy"] == 1.0 and stats["dpo_margin"] == pytest.approx(0.05)


def test_kl_estimators_and_kl_term() -> None:
    # log pi/ref = (0.5, -0.5): k1 mean 0 ; k2 = 0.5 * 0.25 = 0.125 ; k3 = e^-x - 1 + x:
    # (e^-0.5 - 0.5) and (e^0.5 - 1.5) -> (0.1065307 + 0.1487213) / 2 = 0.127626
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.5]])
    assert float(kl_estimate(logp, ref, "k1").mean()) == pytest.approx(0.0)
    assert float(kl_estimate(logp, ref, "k2").mean()) == pytest.approx(0.125)
    assert float(kl_estimate(logp, ref, "k3").mean()) == pytest.approx(0.127626, abs=1e-6)
    # GRPO with ratio 1 everywhere and A = 0: pg term 0 ; total = kl_coef * k3 = 0.2 * 0.127626
    cfg = AlgorithmConfig(name="grpo", kl_coef=0.2)
    x = inputs(cfg, logp.clone().requires_grad_(True), old=logp.clone(), mask=torch.ones(1, 2), adv=torch.zeros(1),
               ref_logp=ref)
    loss, stats = make_algorithm(cfg).loss(x)
    assert float(loss.detach()) == pytest.approx(0.2 * 0.127626, abs=1e-6)
    assert stats["kl"] == pytest.approx(0.127626, abs=1e-6) and stats["kl_loss"] == pytest.approx(0.0255252, abs=1e-6)


def test_entropy_bonus() -> None:
    # entropy (1.0, 2.0) -> mean 1.5 ; coef 0.1 -> total = pg (0) - 0.15
    cfg = AlgorithmConfig(name="grpo", entropy_coef=0.1)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    x = inputs(cfg, logp, old=logp.detach(), mask=torch.ones(1, 2), adv=torch.zeros(1),
               entropy=torch.tensor([[1.0, 2.0]]))
    loss, stats = make_algorithm(cfg).loss(x)
    assert float(loss.detach()) == pytest.approx(-0.15) and stats["entropy"] == pytest.approx(1.5)
    assert stats["entropy_loss"] == pytest.approx(-0.15)


def test_tis_weights_for_stale_rows() -> None:
    # row 0 stale: prox (-1, -1.5) vs rollout (-2, -1) -> raw exp(1) = 2.71828, exp(-0.5) = 0.60653 ; cap 2
    # row 0's ratio is now taken against prox ; row 1 (fresh) keeps the rollout and weight 1
    cfg = AlgorithmConfig(name="grpo", tis_cap=2.0)
    rollout = torch.tensor([[-2.0, -1.0], [-1.0, -1.0]])
    prox = torch.tensor([[-1.0, -1.5], [-3.0, -3.0]])
    x = make_inputs(cfg, prox.clone().requires_grad_(True), rollout, torch.ones(2, 2), torch.tensor([1.0, 1.0]),
                    torch.tensor([True, False]), prox_logp=prox)
    torch.testing.assert_close(x.tis_weight, torch.tensor([[2.0, math.exp(-0.5)], [1.0, 1.0]]))
    torch.testing.assert_close(x.old_logp, torch.tensor([[-1.0, -1.5], [-1.0, -1.0]]))
    assert x.stats["tis_ratio_max"] == pytest.approx(math.e, rel=1e-6)
    assert x.stats["tis_ratio_mean"] == pytest.approx((math.e + math.exp(-0.5)) / 2, rel=1e-6)
    assert x.stats["tis_clip_frac"] == 0.5 and x.stats["stale_frac"] == 0.5
    # GRPO loss: row 0 ratio 1 (new = prox): -1 * weights (2, 0.60653) ; row 1 (A = 1) ratio exp(-2) = 0.13534:
    # max(-0.13534, -clip = -0.8) = -0.13534 -> per token (-2, -0.60653, -0.13534, -0.13534), mean = -2.87720 / 4
    loss, _ = make_algorithm(cfg).loss(x)
    assert float(loss.detach()) == pytest.approx(-(2 + math.exp(-0.5) + 2 * math.exp(-2)) / 4, abs=1e-6)
    off = make_inputs(AlgorithmConfig(tis=False), prox, rollout, torch.ones(2, 2), torch.ones(2),
                      torch.tensor([True, False]), prox_logp=prox)
    assert bool((off.tis_weight == 1).all()) and torch.equal(off.old_logp, rollout)


def sample(group: str, reward: float, sid: str) -> Sample:
    return make_sample(group, reward, size=3, id=sid, tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0])


def test_dpo_pairs_best_and_worst_of_each_group_and_keeps_pairs_together() -> None:
    samples = [sample("g1", 0.0, "a"), sample("g1", 1.0, "b"), sample("g1", 0.5, "c"),
               sample("g2", 1.0, "d"), sample("g2", 1.0, "e"), sample("g2", 1.0, "f"),  # a tie: no pair
               sample("g3", -1.0, "g"), sample("g3", 0.0, "h"), sample("g3", 2.0, "i")]
    plan = make_algorithm(AlgorithmConfig(name="dpo", minibatches=2)).prepare(samples, 0)
    assert [s.id for s in plan.samples] == ["b", "a", "i", "g"]
    assert plan.minibatches == [[0, 1], [2, 3]]


def test_sft_filter_and_stale_flags() -> None:
    samples = [sample("g", 0.0, "a"), sample("g", 1.0, "b").model_copy(update={"weight_versions": [2, 3]})]
    plan = make_algorithm(AlgorithmConfig(name="sft", sft_min_reward=0.5)).prepare(samples, 3)
    assert [s.id for s in plan.samples] == ["b"] and plan.stale.tolist() == [True]
    plan = make_algorithm(AlgorithmConfig(name="grpo")).prepare(samples, 2)  # a: version 0 < 2 ; b: oldest turn 2
    assert plan.stale.tolist() == [True, False]


def test_registry_names_and_plugins() -> None:
    assert set(ALGORITHMS) == {"grpo", "dr_grpo", "ppo", "gspo", "cispo", "reinforce_pp", "reinforce_pp_baseline",
                               "sft", "dpo"}
    assert load_algorithm_class("services.training.algorithms.policy_gradient:PPO") is ALGORITHMS["ppo"]
    with pytest.raises(ValueError, match="available: grpo, dr_grpo"):
        load_algorithm_class("nope")
    with pytest.raises(ValueError, match="not a subclass"):
        load_algorithm_class("services.training.grpo:token_logprobs")
    with pytest.raises(ValueError, match="cannot load plug-in"):
        load_algorithm_class("services.nowhere:Algo")


def test_bad_algorithm_name_fails_at_config_load_with_the_list() -> None:
    data = {"run": {"name": "r"}, "environment": {"name": "tictactoe", "roles": {"X": "A"}},
            "agents": {"A": {"model_path": "m", "algorithm": {"name": "ppo-magic"}}}}
    with pytest.raises(ConfigError, match=r"agents\.A\.algorithm\.name.*available: grpo, dr_grpo, ppo"):
        parse_config(data)


def toy_step(cfg: AlgorithmConfig, ref: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGD step on a free logits table [T=2, V=3] with only the add-on term active (A = 0)."""
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]], requires_grad=True)
    targets = torch.tensor([[0, 1]])
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets.T).T
    ent = -(logp_all.exp() * logp_all).sum(-1).unsqueeze(0) if entropy else None
    x = make_inputs(cfg, logp, logp.detach(), torch.ones(1, 2), torch.zeros(1), torch.zeros(1, dtype=torch.bool),
                    ref_logp=ref, entropy=ent)
    loss, _ = make_algorithm(cfg).loss(x)
    loss.backward()
    with torch.no_grad():
        new = torch.log_softmax(logits - 0.5 * logits.grad, -1)
    return new.gather(-1, targets.T).T.detach(), (-(new.exp() * new).sum(-1)).detach()


@pytest.mark.parametrize("est", ["k2", "k3"])
def test_kl_step_pulls_towards_the_reference(est: str) -> None:
    ref = torch.tensor([[-1.5, -0.2]])
    before = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]), -1).gather(-1, torch.tensor([[0],
                                                                                                               [1]])).T
    after, _ = toy_step(AlgorithmConfig(kl_coef=1.0, kl_estimator=est), ref, entropy=False)
    assert bool(((after - ref).abs() < (before - ref).abs()).all())


def test_entropy_step_raises_entropy() -> None:
    start = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]), -1)
    _, ent_after = toy_step(AlgorithmConfig(entropy_coef=1.0), None, entropy=True)  # type: ignore[arg-type]
    assert bool((ent_after > -(start.exp() * start).sum(-1)).all())
