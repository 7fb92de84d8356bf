"""Tests of server.movement_priors: ranges, shapes, invariants and the refit command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from server.dental_constants import IS_MOLAR, MM_PER_DEG, TOOTH_CLASS, TOOTH_CLASSES
from server.movement_priors import AnchoragePrior, CombinedPrior, RealismPrior
from server.movement_reference import DEFAULT_REFERENCE_PATH, load_reference, tooth_movement_mm
from server.quaternion_utils import quaternion_from_rotvec, quaternion_multiply, quaternion_normalize

REPO_ROOT = Path(__file__).resolve().parents[1]


def _config(rng: np.random.Generator, batch: tuple[int, ...] = ()) -> np.ndarray:
    q = quaternion_normalize(rng.normal(size=(*batch, 28, 4)))
    t = rng.normal(0.0, 20.0, size=(*batch, 28, 3))
    return np.concatenate((q, t), axis=-1)


def _translated(config: np.ndarray, shift_mm: np.ndarray) -> np.ndarray:
    """Copy of ``config`` with each tooth moved along x by ``shift_mm`` (28,)."""
    out = config.copy()
    out[..., 4] += shift_mm
    return out


def _priors() -> tuple[RealismPrior, AnchoragePrior, CombinedPrior]:
    return RealismPrior(), AnchoragePrior(), CombinedPrior()


hostile_floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
hostile_configs = arrays(np.float64, (28, 7), elements=hostile_floats)


def _with_nans(config: np.ndarray, mask: np.ndarray) -> np.ndarray:
    out = config.copy()
    out[mask] = np.nan
    return out


# --- ranges and finiteness -----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(initial=hostile_configs, final=hostile_configs)
def test_hostile_inputs_give_finite_scores_in_unit_interval(initial: np.ndarray, final: np.ndarray) -> None:
    for prior in _priors():
        s = prior.score(initial, final)
        assert isinstance(s, float)
        assert np.isfinite(s)
        assert 0.0 <= s <= 1.0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.0, 0.1, 1.0, 10.0, 1e3, 1e300]),
    nan_mask=arrays(np.bool_, (28, 7)),
)
def test_random_and_nan_poses_give_finite_scores(seed: int, scale: float, nan_mask: np.ndarray) -> None:
    rng = np.random.default_rng(seed)
    initial = _config(rng)
    final = initial.copy()
    final[:, 4:] += rng.normal(0.0, 1.0, size=(28, 3)) * scale
    final[:, :4] = quaternion_normalize(final[:, :4] + rng.normal(0.0, 0.1, size=(28, 4)))
    final = _with_nans(final, nan_mask)
    for prior in _priors():
        s = prior.score(initial, final)
        assert np.isfinite(s) and 0.0 <= s <= 1.0
    m = tooth_movement_mm(initial, final)
    assert not np.isnan(m).any()
    assert (m[nan_mask.any(axis=1)] == 0.0).all()


def test_all_nan_final_counts_as_no_movement() -> None:
    initial = _config(np.random.default_rng(1))
    final = np.full((28, 7), np.nan)
    realism, anchorage, combined = _priors()
    assert realism.score(initial, final) == pytest.approx(0.5)
    assert anchorage.score(initial, final) == pytest.approx(1.0)
    assert combined.score(initial, final) == pytest.approx(0.75)


def test_zero_quaternion_counts_as_no_movement() -> None:
    initial = _config(np.random.default_rng(2))
    final = initial.copy()
    final[0, :4] = 0.0
    assert tooth_movement_mm(initial, final)[0] == 0.0


# --- shapes ---------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 6))
def test_batch_and_single_give_identical_values(seed: int, batch: int) -> None:
    rng = np.random.default_rng(seed)
    initial = _config(rng, (batch,))
    final = initial.copy()
    final[..., 4:] += rng.lognormal(0.0, 1.0, size=(batch, 28, 1)) * rng.normal(size=(batch, 28, 3))
    final[rng.uniform(size=(batch, 28, 7)) < 0.05] = np.nan
    for prior in _priors():
        batched = prior.score(initial, final)
        assert isinstance(batched, np.ndarray) and batched.shape == (batch,)
        single = np.array([prior.score(initial[i], final[i]) for i in range(batch)])
        # Same elementwise formulas; allow only SIMD last-ulp differences.
        np.testing.assert_allclose(batched, single, rtol=1e-13, atol=1e-15)


def test_single_initial_broadcasts_against_batch_of_finals() -> None:
    rng = np.random.default_rng(3)
    initial = _config(rng)
    finals = np.stack([_translated(initial, rng.uniform(0, 5, size=28)) for _ in range(4)])
    s = CombinedPrior().score(initial, finals)
    assert s.shape == (4,)
    assert s[2] == pytest.approx(CombinedPrior().score(initial, finals[2]))


def test_wrong_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="28, 7"):
        RealismPrior().score(np.zeros((27, 7)), np.zeros((27, 7)))


def test_large_batch_is_vectorised() -> None:
    rng = np.random.default_rng(4)
    initial = _config(rng, (1024,))
    final = initial + np.concatenate((np.zeros((1024, 28, 4)), rng.normal(size=(1024, 28, 3))), axis=-1)
    for prior in _priors():
        s = prior.score(initial, final)
        assert s.shape == (1024,)
        assert np.isfinite(s).all() and (s >= 0).all() and (s <= 1).all()


# --- invariants -----------------------------------------------------------------------------


def test_no_movement_scores() -> None:
    initial = _config(np.random.default_rng(5))
    realism, anchorage, combined = _priors()
    assert realism.score(initial, initial) == pytest.approx(0.5)
    assert anchorage.score(initial, initial) == pytest.approx(1.0)
    assert combined.score(initial, initial) == pytest.approx(0.75)


def test_large_molar_movement_lowers_anchorage() -> None:
    initial = _config(np.random.default_rng(6))
    shift = np.where(IS_MOLAR, 6.0, 0.0)
    prior = AnchoragePrior()
    moved = prior.score(initial, _translated(initial, shift))
    assert moved < prior.score(initial, initial)
    p90 = prior.p90_mm
    assert moved == pytest.approx(np.exp(-(6.0 - p90) / p90))
    # Within the 90th percentile a molar movement is not penalised.
    assert prior.score(initial, _translated(initial, np.where(IS_MOLAR, 0.5 * p90, 0.0))) == 1.0


def test_realism_peaks_at_class_median() -> None:
    prior = RealismPrior()
    ref = load_reference()
    initial = _config(np.random.default_rng(7))
    median = np.exp(ref.mu[TOOTH_CLASS])
    at_median = prior.score(initial, _translated(initial, median))
    at_ten_times = prior.score(initial, _translated(initial, 10.0 * median))
    assert at_median == pytest.approx(1.0)
    assert at_median > at_ten_times
    assert prior.score(initial, _translated(initial, 0.1 * median)) < at_median


def test_rotation_counts_via_mm_per_deg() -> None:
    initial = _config(np.random.default_rng(8))
    final = initial.copy()
    step = quaternion_from_rotvec(np.array([0.0, 0.0, np.radians(8.0)]))
    final[:, :4] = quaternion_multiply(step, initial[:, :4])
    np.testing.assert_allclose(tooth_movement_mm(initial, final), 8.0 * MM_PER_DEG, rtol=1e-6)


def test_scores_differ_between_finals() -> None:
    rng = np.random.default_rng(9)
    initial = _config(rng)
    final_a = _translated(initial, np.full(28, 1.5))
    final_b = _translated(initial, np.full(28, 5.0))
    for prior in _priors():
        assert prior.score(initial, final_a) != prior.score(initial, final_b)


def test_weight_realism_selects_component() -> None:
    initial = _config(np.random.default_rng(10))
    final = _translated(initial, np.full(28, 4.0))
    assert CombinedPrior(weight_realism=1.0).score(initial, final) == pytest.approx(
        RealismPrior().score(initial, final)
    )
    assert CombinedPrior(weight_realism=0.0).score(initial, final) == pytest.approx(
        AnchoragePrior().score(initial, final)
    )
    with pytest.raises(ValueError):
        CombinedPrior(weight_realism=1.5)


# --- reference data --------------------------------------------------------------------------


def test_default_reference_is_documented_synthetic_data() -> None:
    data = json.loads(DEFAULT_REFERENCE_PATH.read_text())
    meta = data["metadata"]
    assert "NOT patient data" in meta["provenance"]
    assert any("Haouili" in s for s in meta["sources"])
    assert any("not been verified" in s.lower() for s in meta["sources"])
    for key in ("fitted_from", "n_pairs", "created_by"):
        assert key in meta
    ref = load_reference()
    medians = dict(zip(TOOTH_CLASSES, np.exp(ref.mu), strict=True))
    assert medians["incisor"] > medians["canine"] > medians["premolar"] > medians["molar"]
    assert 1.6 < medians["incisor"] < 2.4 and 0.6 < medians["molar"] < 1.0
    assert (ref.sigma > 0.55).all() and (ref.sigma < 0.85).all()
    assert 1.6 < ref.p90_mm[TOOTH_CLASSES.index("molar")] < 2.4
    assert load_reference() is ref  # cached


def test_from_file_uses_the_given_parameters(tmp_path: Path) -> None:
    data = json.loads(DEFAULT_REFERENCE_PATH.read_text())
    data["classes"]["molar"]["p90_mm"] = 0.5
    data["classes"]["incisor"]["mu"] = float(np.log(5.0))
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(data))
    initial = _config(np.random.default_rng(11))
    final = _translated(initial, np.full(28, 1.5))
    assert AnchoragePrior.from_file(path).p90_mm == 0.5
    assert AnchoragePrior.from_file(path).score(initial, final) < AnchoragePrior().score(initial, final)
    assert RealismPrior.from_file(path).score(initial, final) != RealismPrior().score(initial, final)
    assert CombinedPrior.from_file(path).score(initial, final) != CombinedPrior().score(initial, final)


# --- refit command -------------------------------------------------------------------------


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "server.movement_reference", *args],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _write_pairs(directory: Path, mu: np.ndarray, sigma: float, n: int, seed: int) -> None:
    """``n`` pair files whose per-tooth translations are log-normal(mu[class], sigma) mm."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        pre = _config(rng)
        m = np.exp(rng.normal(mu[TOOTH_CLASS], sigma))
        direction = rng.normal(size=(28, 3))
        direction /= np.linalg.norm(direction, axis=1, keepdims=True)
        post = pre.copy()
        post[:, 4:] += direction * m[:, None]
        (directory / f"pair_{i:03d}.json").write_text(
            json.dumps({"pre": pre.tolist(), "post": post.tolist()})
        )


def test_refit_round_trip(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    mu = np.log(np.array([3.0, 2.5, 1.2, 0.6]))
    _write_pairs(pairs, mu, sigma=0.5, n=30, seed=12)
    (pairs / "broken.json").write_text("{not json")
    (pairs / "short.json").write_text(json.dumps({"pre": [[1, 0, 0, 0, 0, 0, 0]], "post": []}))
    out = tmp_path / "fitted.json"
    proc = _run_cli("refit", "--pairs", str(pairs), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "broken.json" in proc.stderr and "short.json" in proc.stderr
    data = json.loads(out.read_text())
    assert data["metadata"]["provenance"].startswith("fitted from 30 pre/post pairs")
    assert data["metadata"]["n_pairs"] == 30
    assert "patient" not in data["metadata"]["provenance"].lower()
    fitted_mu = np.array([data["classes"][c]["mu"] for c in TOOTH_CLASSES])
    fitted_sigma = np.array([data["classes"][c]["sigma"] for c in TOOTH_CLASSES])
    np.testing.assert_allclose(fitted_mu, mu, atol=0.15)
    np.testing.assert_allclose(fitted_sigma, 0.5, atol=0.1)
    expected_p90 = np.exp(mu[3] + 1.2816 * 0.5)
    assert data["classes"]["molar"]["p90_mm"] == pytest.approx(expected_p90, rel=0.2)
    # The fitted file drives the priors.
    assert AnchoragePrior.from_file(out).p90_mm == pytest.approx(data["classes"]["molar"]["p90_mm"])


def test_refit_empty_folder_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out.json"
    proc = _run_cli("refit", "--pairs", str(empty), "--out", str(out))
    assert proc.returncode == 2
    assert "no *.json files" in proc.stderr and '"pre"' in proc.stderr
    assert not out.exists()


def test_refit_without_valid_pairs_exits_2(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    bad = np.zeros((28, 7)).tolist()  # zero quaternions
    (pairs / "zeros.json").write_text(json.dumps({"pre": bad, "post": bad}))
    proc = _run_cli("refit", "--pairs", str(pairs), "--out", str(tmp_path / "out.json"))
    assert proc.returncode == 2
    assert "zeros.json" in proc.stderr and "norm" in proc.stderr
    assert "none of the 1" in proc.stderr
