"""Dynamo's mocker polynomial model, against numbers computed by hand from its coefficients."""

from __future__ import annotations

import pytest

from kvctl.mock.timing import TimingModel


@pytest.mark.parametrize(("tokens", "ms"), [
    (0, 0.0),  # nothing to compute: no prefill at all
    (128, 16.50142 + 0.01518344 * 128 + 4.209989e-07 * 128**2),  # 16.50142 + 1.94348 + 0.00690 = 18.45180
    (2176, 51.53401),  # 16.50142 + 33.03917 + 1.99342
])
def test_prefill_ms(tokens: int, ms: float) -> None:
    assert TimingModel().prefill_ms(tokens) == pytest.approx(ms, abs=1e-4)


@pytest.mark.parametrize(("usage", "ms"), [
    (0.0, 5.74),
    (0.5, 26.31),  # 5.74 + 27.005 - 6.435
    (1.0, 34.01),
    (1.5, 34.01),  # usage is clamped to [0, 1]
    (-0.2, 5.74),
])
def test_decode_step_ms(usage: float, ms: float) -> None:
    assert TimingModel().decode_step_ms(usage) == pytest.approx(ms, abs=1e-9)


def test_speedup_divides_every_time_and_is_named() -> None:
    model = TimingModel(speedup=2)
    assert model.prefill_ms(2176) == pytest.approx(51.53401 / 2, abs=1e-4)
    assert model.decode_step_ms(0.5) == pytest.approx(26.31 / 2)
    assert model.describe() == ("Dynamo mocker polynomial: prefill 16.5 + 0.0152·n + 4.2e-7·n² ms per prefill of n "
                                "uncached tokens, decode step 5.74 + 54.0·u − 25.7·u² ms at KV usage u, ÷ speedup 2")


@pytest.mark.parametrize("speedup", [0.0, -1.0, float("nan")])
def test_speedup_must_be_positive(speedup: float) -> None:
    with pytest.raises(ValueError, match="speedup must be positive"):
        TimingModel(speedup)
