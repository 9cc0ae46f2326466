"""Closed-loop AQN: the controller moves sigma toward the value that meets its target, stays in
bounds and at a bounded rate, ignores missing measurements, and resumes exactly from its state."""

import json
import math

import pytest

from qerl.rl.aqn import AdaptiveSigma, sigma_at


def entropy_plant(sigma):  # a policy whose rollout entropy rises with the noise
    return 0.3 + 40.0 * sigma


def zero_variance_plant(sigma):  # more noise, fewer groups whose rewards are all equal
    return 0.8 - 50.0 * sigma


@pytest.mark.parametrize("signal,plant,target,sigma_star", [
    ("entropy", entropy_plant, 0.5, (0.5 - 0.3) / 40.0),
    ("zero_variance", zero_variance_plant, 0.5, (0.8 - 0.5) / 50.0),
])
@pytest.mark.parametrize("start", [5e-4, 1e-2])
def test_sigma_converges_to_the_value_that_meets_the_target(signal, plant, target, sigma_star, start):
    c = AdaptiveSigma(target=target, signal=signal, sigma_min=5e-4, sigma_max=1e-2, gain=1.0, sigma=start)
    for _ in range(80):
        c.update(plant(c.sigma))
    assert c.sigma == pytest.approx(sigma_star, rel=0.02)
    assert plant(c.sigma) == pytest.approx(target, rel=0.02)


def test_direction_of_each_signal():
    e = AdaptiveSigma(target=0.5, signal="entropy", sigma=2e-3)
    assert e.update(0.4) > 2e-3  # entropy below target: more noise
    e2 = AdaptiveSigma(target=0.5, signal="entropy", sigma=2e-3)
    assert e2.update(0.6) < 2e-3  # above target: less noise
    e3 = AdaptiveSigma(target=0.5, signal="entropy", sigma=2e-3)
    assert e3.update(0.5) == 2e-3  # on target: unchanged
    z = AdaptiveSigma(target=0.3, signal="zero_variance", sigma=2e-3)
    assert z.update(0.6) > 2e-3  # too many groups without signal: more noise
    z2 = AdaptiveSigma(target=0.3, signal="zero_variance", sigma=2e-3)
    assert z2.update(0.1) < 2e-3


def test_bounds_and_rate_hold_whatever_the_signal():
    c = AdaptiveSigma(target=0.5, signal="entropy", sigma_min=5e-4, sigma_max=1e-2, gain=50.0, sigma=1e-3)
    prev = c.sigma
    for measured in [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, -3.0, 1e9]:
        s = c.update(measured)
        assert 5e-4 <= s <= 1e-2
        assert 0.5 - 1e-12 <= s / prev <= 2.0 + 1e-12  # at most x2 or /2 a step
        prev = s
    assert c.sigma == 5e-4  # driven to the floor by a signal far above target
    for _ in range(10):
        c.update(0.0)
    assert c.sigma == 1e-2  # and to the ceiling by one far below


def test_missing_measurements_leave_sigma_unchanged():
    c = AdaptiveSigma(target=0.5, sigma=3e-3)
    assert c.update(None) == 3e-3 and c.update(float("nan")) == 3e-3 and c.updates == 0


def test_state_round_trips_through_json_and_the_run_continues_identically():
    signals = [0.2, 0.35, 0.9, 0.5, 0.41, 0.47, 0.62, 0.3, 0.55, 0.5]
    a = AdaptiveSigma(target=0.5, signal="entropy")
    for x in signals[:5]:
        a.update(x)
    saved = json.loads(json.dumps(a.state_dict()))  # plain numbers only
    assert set(saved) == {"sigma", "last_measured", "updates", "target"}
    b = AdaptiveSigma(target=0.5, signal="entropy")
    b.load_state_dict(saved)
    assert [a.update(x) for x in signals[5:]] == [b.update(x) for x in signals[5:]]
    assert a.log_row() == b.log_row() == {"aqn_sigma": a.sigma, "aqn_target": 0.5, "aqn_signal": 0.5}


def test_one_step_is_the_log_space_integral_law():
    c = AdaptiveSigma(target=0.5, signal="entropy", gain=0.3, sigma=2e-3)
    assert c.update(0.45) == pytest.approx(2e-3 * math.exp(0.3 * (0.5 - 0.45) / 0.5), rel=1e-12)


def test_bad_settings_and_fixed_schedule_lookup_are_refused():
    with pytest.raises(ValueError, match="signal"):
        AdaptiveSigma(target=0.5, signal="reward")
    with pytest.raises(ValueError, match="sigma_min"):
        AdaptiveSigma(target=0.5, sigma_min=1e-2, sigma_max=1e-3)
    with pytest.raises(ValueError, match="AdaptiveSigma"):
        sigma_at(3, 10, schedule="adaptive")


def test_config_accepts_adaptive_and_its_fields():
    from qerl.rl.config import GRPOConfig

    c = GRPOConfig(aqn_schedule="adaptive", aqn_adaptive_signal="zero_variance", aqn_adaptive_target=0.3)
    ctl = AdaptiveSigma(target=c.aqn_adaptive_target, signal=c.aqn_adaptive_signal, sigma_min=c.aqn_sigma_end,
                        sigma_max=c.aqn_sigma_start, gain=c.aqn_adaptive_gain)
    assert ctl.sigma == c.aqn_sigma_start
    with pytest.raises(ValueError, match="aqn_adaptive_signal"):
        GRPOConfig(aqn_schedule="adaptive", aqn_adaptive_signal="reward")
    with pytest.raises(ValueError, match="aqn_sigma_end"):
        GRPOConfig(aqn_schedule="adaptive", aqn_sigma_end=0.0)


def test_an_unset_target_is_the_first_measurement_and_is_checkpointed():
    c = AdaptiveSigma(target=None, signal="entropy", sigma_min=1e-3, sigma_max=1e-2)
    assert c.update(0.8) == 1e-2 and c.target == 0.8  # the first step sets the level, sigma unmoved
    assert c.update(0.9) < 1e-2  # above the held level: less noise
    st = c.state_dict()
    d = AdaptiveSigma(target=None, signal="entropy", sigma_min=1e-3, sigma_max=1e-2)
    d.load_state_dict(st)
    assert (d.target, d.sigma, d.updates) == (0.8, c.sigma, 2)
    e = AdaptiveSigma(target=0.3, signal="entropy", sigma_min=1e-3, sigma_max=1e-2)
    e.load_state_dict(st)
    assert e.target == 0.3  # a target set in the config wins over the checkpoint's
