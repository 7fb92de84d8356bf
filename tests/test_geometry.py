"""Geometry: quaternion algebra, the ideal arch, adjacent-crown penetration (docs/environment.md, "Conventions", "Cases" and "Scoring")."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from server.arch import ArchParameters, build_ideal_arch
from server.collisions import COLLISION_TOLERANCE_MM, collision_severity, penetration_mm
from server.dental_constants import (
    ADJACENT_PAIRS,
    CROWN_WIDTH_MM,
    IDEAL_OVERBITE_MM,
    IDEAL_OVERJET_MM,
    INTERCANINE_WIDTH_MM,
    INTERMOLAR_WIDTH_MM,
    MAX_CURVE_OF_SPEE_MM,
    N_TEETH,
    TOOTH_IDS,
    TOOTH_INDEX,
    WIDTH_LANDMARK_OFFSET_MM,
)
from server.occlusion import (
    arch_widths_mm,
    centroid_widths_mm,
    curve_of_spee_mm,
    midline_mm,
    molar_relation_mm,
    occlusion_composite,
    overbite_mm,
    overjet_mm,
    six_keys,
)
from server.quaternion_utils import (
    quaternion_about_axis,
    quaternion_angle,
    quaternion_from_rotvec,
    quaternion_inverse,
    quaternion_multiply,
    quaternion_normalize,
    quaternion_rotate,
    quaternion_slerp,
    quaternion_to_rotvec,
)

IDENTITY = np.array([1.0, 0.0, 0.0, 0.0])

# --- strategies ----------------------------------------------------------------------------

_unit_floats = st.floats(-1.0, 1.0, allow_nan=False, allow_infinity=False, width=64)
raw_quaternions = arrays(np.float64, (4,), elements=_unit_floats).filter(lambda q: np.linalg.norm(q) > 0.1)
unit_quaternions = raw_quaternions.map(quaternion_normalize)
vectors = arrays(np.float64, (3,), elements=st.floats(-50.0, 50.0, allow_nan=False, width=64))
# rotation vectors with angle < pi - margin (the principal range where rotvec round-trips exactly)
rotvecs = arrays(np.float64, (3,), elements=st.floats(-1.7, 1.7, allow_nan=False, width=64)).filter(
    lambda v: np.linalg.norm(v) < np.pi - 1e-3
)
fractions = st.floats(0.0, 1.0, allow_nan=False, width=64)


def same_rotation(a: np.ndarray, b: np.ndarray, atol: float = 1e-9) -> bool:
    """q and -q are the same rotation."""
    return bool(np.allclose(a, b, atol=atol) or np.allclose(a, -b, atol=atol))


# --- quaternion utils ------------------------------------------------------------------------


@given(raw_quaternions)
def test_normalize_gives_unit_non_negative_w_and_is_idempotent(q):
    n = quaternion_normalize(q)
    assert np.linalg.norm(n) == pytest.approx(1.0, abs=1e-12)
    assert n[0] >= 0.0
    assert np.allclose(quaternion_normalize(n), n, atol=1e-12)
    assert same_rotation(n, q / np.linalg.norm(q))


@given(unit_quaternions, unit_quaternions, unit_quaternions)
def test_multiply_is_associative_and_preserves_norm(a, b, c):
    left = quaternion_multiply(quaternion_multiply(a, b), c)
    right = quaternion_multiply(a, quaternion_multiply(b, c))
    assert np.allclose(left, right, atol=1e-12)
    assert np.linalg.norm(quaternion_multiply(a, b)) == pytest.approx(1.0, abs=1e-12)


@given(unit_quaternions)
def test_identity_and_inverse(q):
    assert np.allclose(quaternion_multiply(q, IDENTITY), q, atol=1e-15)
    assert np.allclose(quaternion_multiply(IDENTITY, q), q, atol=1e-15)
    assert same_rotation(quaternion_multiply(q, quaternion_inverse(q)), IDENTITY, atol=1e-12)
    assert same_rotation(quaternion_multiply(quaternion_inverse(q), q), IDENTITY, atol=1e-12)
    assert np.allclose(quaternion_inverse(quaternion_inverse(q)), q, atol=0.0)


@given(unit_quaternions, unit_quaternions, vectors)
def test_multiply_composes_rotations_b_then_a(a, b, v):
    composed = quaternion_rotate(quaternion_multiply(a, b), v)
    sequential = quaternion_rotate(a, quaternion_rotate(b, v))
    assert np.allclose(composed, sequential, atol=1e-9)
    # rotations preserve length, the inverse undoes them
    assert np.linalg.norm(quaternion_rotate(a, v)) == pytest.approx(np.linalg.norm(v), abs=1e-9)
    assert np.allclose(quaternion_rotate(quaternion_inverse(a), quaternion_rotate(a, v)), v, atol=1e-9)


def test_rotate_about_z_by_90_degrees_maps_x_to_y():
    q = quaternion_about_axis(np.array([0.0, 0.0, 1.0]), np.pi / 2)
    assert np.allclose(quaternion_rotate(q, np.array([1.0, 0.0, 0.0])), [0.0, 1.0, 0.0], atol=1e-12)


@given(unit_quaternions, unit_quaternions)
def test_slerp_endpoints(q0, q1):
    assert same_rotation(quaternion_slerp(q0, q1, 0.0), q0, atol=1e-9)
    assert same_rotation(quaternion_slerp(q0, q1, 1.0), q1, atol=1e-9)


@given(unit_quaternions, unit_quaternions, fractions)
def test_slerp_is_unit_and_constant_speed_on_the_short_arc(q0, q1, t):
    total = float(quaternion_angle(q0, q1))
    q = quaternion_slerp(q0, q1, t)
    assert np.linalg.norm(q) == pytest.approx(1.0, abs=1e-12)
    assert float(quaternion_angle(q0, q)) == pytest.approx(t * total, abs=1e-6)
    assert float(quaternion_angle(q, q1)) == pytest.approx((1.0 - t) * total, abs=1e-6)


@given(unit_quaternions, unit_quaternions)
def test_slerp_broadcasts_over_a_batch_of_t(q0, q1):
    ts = np.linspace(0.0, 1.0, 7)
    batch = quaternion_slerp(q0, q1, ts)
    assert batch.shape == (7, 4)
    for k, t in enumerate(ts):
        assert np.allclose(batch[k], quaternion_slerp(q0, q1, t), atol=1e-12)


@given(rotvecs)
def test_rotvec_round_trip_from_vector(v):
    q = quaternion_from_rotvec(v)
    assert np.linalg.norm(q) == pytest.approx(1.0, abs=1e-12)
    assert np.allclose(quaternion_to_rotvec(q), v, atol=1e-9)
    assert float(quaternion_angle(IDENTITY, q)) == pytest.approx(np.linalg.norm(v), abs=1e-6)


@given(unit_quaternions)
def test_rotvec_round_trip_from_quaternion(q):
    v = quaternion_to_rotvec(q)
    assert np.linalg.norm(v) <= np.pi + 1e-9
    assert same_rotation(quaternion_from_rotvec(v), q, atol=1e-9)


@given(arrays(np.float64, (3,), elements=st.floats(-1e-9, 1e-9, allow_nan=False, width=64)))
def test_rotvec_of_tiny_rotation_is_stable(v):
    q = quaternion_from_rotvec(v)
    assert np.all(np.isfinite(q))
    assert np.allclose(q, [1.0, *v / 2], atol=1e-15)
    assert np.allclose(quaternion_to_rotvec(q), v, atol=1e-15)


@given(unit_quaternions, unit_quaternions)
def test_angle_is_symmetric_and_matches_relative_rotvec(a, b):
    ab = float(quaternion_angle(a, b))
    assert ab == pytest.approx(float(quaternion_angle(b, a)), abs=1e-12)
    assert 0.0 <= ab <= np.pi + 1e-12
    rel = quaternion_to_rotvec(quaternion_multiply(quaternion_inverse(a), b))
    # arccos loses precision near 0: compare loosely there
    assert ab == pytest.approx(float(np.linalg.norm(rel)), abs=1e-6)
    assert float(quaternion_angle(a, a)) == pytest.approx(0.0, abs=1e-6)


@settings(max_examples=25)
@given(arrays(np.float64, (5, 3, 4), elements=_unit_floats))
def test_batched_operations_match_elementwise(raw):
    assume(np.all(np.linalg.norm(raw, axis=-1) > 0.1))
    q = quaternion_normalize(raw)
    p = q[:, ::-1]
    batch = quaternion_multiply(q, p)
    assert batch.shape == (5, 3, 4)
    for i in range(5):
        for j in range(3):
            assert np.allclose(batch[i, j], quaternion_multiply(q[i, j], p[i, j]), atol=1e-15)
    assert quaternion_to_rotvec(q).shape == (5, 3, 3)


# --- the ideal arch ----------------------------------------------------------------------------


def test_nominal_arch_hits_class_i_norms():
    arch = build_ideal_arch(ArchParameters())
    widths = arch_widths_mm(arch.poses)
    assert float(widths["upper_intercanine"]) == pytest.approx(INTERCANINE_WIDTH_MM["upper"][0], abs=0.2)
    assert float(widths["lower_intercanine"]) == pytest.approx(INTERCANINE_WIDTH_MM["lower"][0], abs=0.2)
    assert float(widths["upper_intermolar"]) == pytest.approx(INTERMOLAR_WIDTH_MM["upper"][0], abs=0.2)
    assert float(widths["lower_intermolar"]) == pytest.approx(INTERMOLAR_WIDTH_MM["lower"][0], abs=0.2)
    # the norms hold at their landmarks (cusp tips, buccal surfaces); the centroids lie inside them by
    # twice each landmark's outward offset (its transverse part), not on them
    centroid = centroid_widths_mm(arch.poses)
    for k, name in enumerate(widths):
        offset = WIDTH_LANDMARK_OFFSET_MM["upper" if name.startswith("upper") else "lower"][k // 2]
        inside = float(widths[name] - centroid[name])
        assert 1.2 * offset <= inside <= 2 * offset, (name, inside)
    # crown widths derived from the contacts stay close to Wheeler's means
    assert np.allclose(arch.crown_width_mm, CROWN_WIDTH_MM, rtol=0.05), arch.crown_width_mm


def test_nominal_arch_has_ideal_occlusion():
    arch = build_ideal_arch(ArchParameters())
    p = arch.poses
    assert IDEAL_OVERJET_MM[0] <= float(overjet_mm(p)) <= IDEAL_OVERJET_MM[1]
    assert IDEAL_OVERBITE_MM[0] <= float(overbite_mm(p)) <= IDEAL_OVERBITE_MM[1]
    assert np.allclose(molar_relation_mm(p), 0.0, atol=0.05)
    assert 0.0 <= float(curve_of_spee_mm(p)) <= MAX_CURVE_OF_SPEE_MM
    assert float(midline_mm(p)) == pytest.approx(0.0, abs=1e-9)
    keys = six_keys(p, p, arch.crown_width_mm)
    assert all(float(v) >= 0.99 for v in keys.values()), keys
    assert float(occlusion_composite(p, p, arch.crown_width_mm)) >= 0.99


def test_ideal_arch_is_mirror_symmetric():
    p = build_ideal_arch(ArchParameters()).poses
    for fdi in TOOTH_IDS:
        q, n = divmod(fdi, 10)
        twin = {1: 2, 2: 1, 3: 4, 4: 3}[q] * 10 + n
        a, b = p[TOOTH_INDEX[fdi], 4:], p[TOOTH_INDEX[twin], 4:]
        assert np.allclose([a[0], a[1], a[2]], [-b[0], b[1], b[2]], atol=1e-9), fdi


# --- penetration ---------------------------------------------------------------------------------


def _nominal():
    arch = build_ideal_arch(ArchParameters())
    return arch.poses.copy(), arch.crown_width_mm, arch.crown_depth_mm


def test_ideal_arch_neighbours_touch_without_penetrating():
    poses, width, depth = _nominal()
    pen = penetration_mm(poses, width, depth)
    assert pen.shape == (len(ADJACENT_PAIRS),) == (26,)
    assert pen.max() <= COLLISION_TOLERANCE_MM
    # in contact, not spaced apart
    assert pen.min() >= -0.5
    assert float(collision_severity(pen)) == 0.0


@given(
    st.floats(-20, 20, allow_nan=False),
    st.floats(-20, 20, allow_nan=False),
    st.floats(-np.pi, np.pi, allow_nan=False),
)
@settings(max_examples=30)
def test_penetration_is_invariant_under_a_rigid_motion_of_the_whole_arch(dx, dy, yaw):
    poses, width, depth = _nominal()
    q = quaternion_about_axis(np.array([0.0, 0.0, 1.0]), yaw)
    moved = poses.copy()
    moved[:, :4] = quaternion_multiply(q, poses[:, :4])
    moved[:, 4:] = quaternion_rotate(q, poses[:, 4:]) + np.array([dx, dy, 0.0])
    assert np.allclose(penetration_mm(moved, width, depth), penetration_mm(poses, width, depth), atol=1e-9)


def test_pushing_a_tooth_into_its_neighbour_penetrates_and_pulling_it_away_clears():
    poses, width, depth = _nominal()
    i, j = TOOTH_INDEX[11], TOOTH_INDEX[12]
    k = next(n for n, (a, b) in enumerate(ADJACENT_PAIRS) if {a, b} == {i, j})
    towards = poses[j, 4:6] - poses[i, 4:6]
    towards /= np.linalg.norm(towards)
    base = penetration_mm(poses, width, depth)[k]
    pushed = poses.copy()
    pushed[i, 4:6] += 1.0 * towards
    pulled = poses.copy()
    pulled[i, 4:6] -= 1.0 * towards
    assert penetration_mm(pushed, width, depth)[k] == pytest.approx(base + 1.0, abs=0.05)
    assert penetration_mm(pulled, width, depth)[k] == pytest.approx(base - 1.0, abs=0.05)
    assert float(collision_severity(penetration_mm(pushed, width, depth))) > 0.5


def test_rotating_a_crown_ninety_degrees_clears_its_contacts():
    """Crowns are ellipses: a tooth turned on its long axis presents its narrow side."""
    poses, width, depth = _nominal()
    i = TOOTH_INDEX[12]
    turned = poses.copy()
    turned[i, :4] = quaternion_multiply(
        poses[i, :4], quaternion_about_axis(np.array([0.0, 0.0, 1.0]), np.pi / 2)
    )
    contacts = [n for n, (a, b) in enumerate(ADJACENT_PAIRS) if i in (a, b)]
    before = penetration_mm(poses, width, depth)[contacts]
    after = penetration_mm(turned, width, depth)[contacts]
    assert np.all(after < before - 1.0)


def test_penetration_broadcasts_over_batches():
    poses, width, depth = _nominal()
    batch = np.broadcast_to(poses, (3, 5, N_TEETH, 7))
    out = penetration_mm(batch, np.broadcast_to(width, (3, 5, N_TEETH)), depth)
    assert out.shape == (3, 5, 26)
    assert np.allclose(out, penetration_mm(poses, width, depth))


def test_far_second_neighbours_are_bounded_not_measured():
    """Crowns one apart are measured only when some pair is within reach: otherwise the clearance is
    an upper bound of the ellipses' (the sum of the larger half-dimensions less the distance), still
    negative, so a collision is read the same; where a pair is near, every pair is measured exactly."""
    from server.cases import generate_case
    from server.collisions import (
        SECOND_CROWNS,
        CrownContacts,
        _gathered_penetration,
        all_pairs_penetration_mm,
        second_neighbour_penetration_mm,
    )

    rng = np.random.default_rng(5)
    for seed in range(20):
        case = generate_case("task_medium", seed)
        w, d = case.crown_width_mm, case.crown_depth_mm
        inv_d2 = 4.0 / np.square(d)
        crowns = CrownContacts(inv_d2[SECOND_CROWNS], (4.0 / np.square(w) - inv_d2)[SECOND_CROWNS])
        poses = np.repeat(case.initial[None], 6, 0)
        poses[3:, :, 4:6] += rng.normal(0.0, 4.0, (3, 28, 2))  # some crowns one apart brought together
        exact = _gathered_penetration(poses[:3], crowns, SECOND_CROWNS)
        fast = second_neighbour_penetration_mm(poses[:3], w, d)
        assert np.all(fast >= exact - 1e-12) and np.all(fast < 0.0)  # the aligned arch: far, bounded
        # brought together: within reach, so every pair is measured exactly, with the contacts
        near = _gathered_penetration(poses, crowns, SECOND_CROWNS)
        assert np.any(near > -1.0)
        assert np.array_equal(second_neighbour_penetration_mm(poses, w, d), near)
        both = all_pairs_penetration_mm(poses, w, d)
        assert np.array_equal(both[..., 26:], near)
        assert np.array_equal(both[..., :26], penetration_mm(poses, w, d))
