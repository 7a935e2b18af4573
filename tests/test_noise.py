import math

import pytest
import torch

from dflash.training.noise import NOISES, NoiseConfig, build_noise


def test_cosine_endpoints_and_monotonic():
    s = build_noise(NoiseConfig(name="cosine", start=0.1, end=0.01), total_steps=100)
    vals = [s.sigma_at(i) for i in range(0, 131)]
    assert math.isclose(vals[0], 0.1) and math.isclose(vals[100], 0.01) and math.isclose(vals[130], 0.01)
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert math.isclose(s.sigma_at(50), 0.055)


def test_schedule_advanced_by_trainer_is_read_by_all():
    s = build_noise(NoiseConfig(name="cosine", steps=10), total_steps=999)
    s.advance(10)
    assert math.isclose(s.sigma(), 0.01)


@pytest.mark.parametrize("name", ["uniform", "gaussian", "cosine"])
def test_noise_skips_last_selected_layer(name):
    s = build_noise(NoiseConfig(name=name, sigma=0.05, distribution="gaussian" if name == "gaussian" else "uniform"), 10)
    x = torch.zeros(7, 4, 16)  # [T, L, H]
    y = s.add(x, s.sigma(), torch.Generator().manual_seed(0))
    assert torch.equal(y[:, -1], x[:, -1])
    assert (y[:, :-1] != 0).float().mean() > 0.99
    if name != "gaussian":
        assert y.abs().max() <= s.sigma() + 1e-7
    assert torch.equal(x, torch.zeros_like(x)), "input must not be modified in place"


def test_none_is_identity_and_registry_errors():
    s = build_noise(NoiseConfig(), 10)
    x = torch.randn(3, 2, 4)
    assert s.add(x, s.sigma()) is x
    assert set(NOISES) == {"none", "uniform", "gaussian", "cosine"}
    with pytest.raises(ValueError, match="noise.name"):
        build_noise(NoiseConfig(name="pink"), 10)
