"""A real jaw against the model: Open-Full-Jaw Patient 26 (CBCT; ``tests/data``, derived by
``scripts/open_full_jaw_fixture.py``), converted into the project's frame and pose convention.

* The arch-width norms hold at the landmarks they are measured at (canine cusp tips, the first molars'
  buccal surfaces), and this jaw's landmarks lie where the model puts them relative to the crown
  centroids; so the generated targets' centroid widths are as far from this jaw's as this jaw is from
  the norms at the landmarks (the jaw is narrow at the canines: its cusp tips 31.3 / 24.2 mm apart,
  against norms of 35.4 / 26.9).
* Imported as a case with its own arrangement as initial and target, it breaks no hard rule at rest,
  the do-nothing plan scores what it scores on a generated ideal arch (but for the occlusion this
  patient has: a Class III molar relation on the left side), and its diagnosis from the geometry is
  that it needs no treatment.

The crowns' measured sizes do not fit the collision model exactly: as occlusal-plane ellipses through
the centroids, four of the 26 contacts overlap by 0.27-0.59 mm (a crown's contact is where it meets its
neighbour in 3-D, and a crown tipped or lingual of its neighbour overlaps it in projection: the lower
lateral incisor behind the canine). The case is imported with each crown's width reduced until its
ellipse just touches its neighbours (:func:`_touching_widths`), at most 14 % (0.75 mm) below the
measured width.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from server.arch import WIDTH_NAMES, WIDTH_TEETH, ArchParameters, build_ideal_arch
from server.case_records import FORMAT, case_of_record
from server.cases import TASK_IDS, generate_case
from server.collisions import (
    COLLISION_TOLERANCE_MM,
    CONTACT_CROWNS,
    penetration_mm,
    second_neighbour_penetration_mm,
)
from server.dental_constants import (
    IDEAL_OVERBITE_MM,
    IDEAL_OVERJET_MM,
    INTERCANINE_WIDTH_MM,
    INTERMOLAR_WIDTH_MM,
    IS_UPPER,
    MAX_CURVE_OF_SPEE_MM,
    MIRROR_INDEX,
    SIDE,
    TOOTH_IDS,
    UPPER_PAIRS,
    WIDTH_LANDMARK_OFFSET_MM,
)
from server.occlusion import arch_widths_mm, centroid_widths_mm, curve_of_spee_mm, overbite_mm, overjet_mm
from server.quaternion_utils import quaternion_axis
from server.treatment import score_plans

FIXTURE = Path(__file__).parent / "data" / "open_full_jaw_patient26.json"
REFLECT = np.array([1.0, -1.0, 1.0])
"""The CBCT frame (x to the patient's left, y posterior, z superior) to the project's axes (x left, y
anterior, z up): a reflection, so the project's frame is the mirror image of the CBCT's handedness
and each crown's axes are re-signed to the project's convention (below)."""
DO_NOTHING = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]}
NORMS = np.array(
    [
        INTERCANINE_WIDTH_MM["upper"],
        INTERCANINE_WIDTH_MM["lower"],
        INTERMOLAR_WIDTH_MM["upper"],
        INTERMOLAR_WIDTH_MM["lower"],
    ]
)
"""(4, 2) mean and SD of each width of :data:`server.arch.WIDTH_NAMES`."""
OFFSETS = np.array(
    [
        WIDTH_LANDMARK_OFFSET_MM["upper"][0],
        WIDTH_LANDMARK_OFFSET_MM["lower"][0],
        WIDTH_LANDMARK_OFFSET_MM["upper"][1],
        WIDTH_LANDMARK_OFFSET_MM["lower"][1],
    ]
)


def matrix_to_quaternion(r: np.ndarray) -> np.ndarray:
    """Unit quaternions (..., 4), w first and >= 0, of rotation matrices (..., 3, 3) whose columns are
    the crown's local axes in the patient frame (Shepperd's method: from the largest diagonal term)."""
    m00, m11, m22 = r[..., 0, 0], r[..., 1, 1], r[..., 2, 2]
    d21, d02, d10 = r[..., 2, 1] - r[..., 1, 2], r[..., 0, 2] - r[..., 2, 0], r[..., 1, 0] - r[..., 0, 1]
    s01, s02, s12 = r[..., 0, 1] + r[..., 1, 0], r[..., 0, 2] + r[..., 2, 0], r[..., 1, 2] + r[..., 2, 1]
    diag = np.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22], -1)
    rows = np.stack(
        [
            np.stack([diag[..., 0], d21, d02, d10], -1),
            np.stack([d21, diag[..., 1], s01, s02], -1),
            np.stack([d02, s01, diag[..., 2], s12], -1),
            np.stack([d10, s02, s12, diag[..., 3]], -1),
        ],
        -2,
    )
    q = np.take_along_axis(rows, np.argmax(diag, -1)[..., None, None], -2)[..., 0, :]
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    return np.where(q[..., :1] < 0, -q, q)


def real_jaw() -> dict:
    """The fixture in the project's frame: ``poses`` (28, 7) in TOOTH_IDS order, ``axes`` (28, 3, 3)
    (columns: each crown's local x, y, z), the measured ``width`` and ``depth`` (28,) mm, and the
    landmarks ``cusp_tip`` and ``buccal_point`` (28, 3) mm.

    The frame is fitted rigidly (after the reflection :data:`REFLECT`): z the normal of the
    least-squares plane through the 28 crown centres (towards the upper crowns), x the mean left-minus-
    right vector of contralateral crowns in that plane, y = z x x (anterior); the origin on that plane,
    at the centres' mean across (the midline) and at the upper central incisors' centres along y (as
    the generator's arch). Each crown's axes: local x along the arch towards the patient's left (the
    dataset's x points distally: its sign flips on the right side), local y labial, local z towards
    the upper jaw (the dataset's z points to the incisal / occlusal end: its sign flips for upper crowns).
    """
    teeth = json.loads(FIXTURE.read_text())["teeth"]

    def column(key: str) -> np.ndarray:
        return np.array([teeth[str(t)][key] for t in TOOTH_IDS], dtype=float)

    centre = column("c") * REFLECT
    mean = centre.mean(axis=0)
    normal = np.linalg.svd(centre - mean)[2][2]
    normal *= np.sign((centre[IS_UPPER].mean(axis=0) - mean) @ normal)
    lateral = (centre - centre[MIRROR_INDEX])[SIDE > 0].mean(axis=0)
    lateral -= (lateral @ normal) * normal
    lateral /= np.linalg.norm(lateral)
    frame = np.stack([lateral, np.cross(normal, lateral), normal])  # rows: the project's x, y, z
    origin = mean + frame[1] * float(np.mean((centre[UPPER_PAIRS[0]] - mean) @ frame[1]))

    def point(p: np.ndarray) -> np.ndarray:
        return (p * REFLECT - origin) @ frame.T

    local = np.stack(
        [
            SIDE[:, None] * column("x"),
            column("y"),
            np.where(IS_UPPER, -1.0, 1.0)[:, None] * column("z"),
        ],
        axis=-1,
    )  # (28, 3, 3) columns in the CBCT frame
    axes = np.einsum("ij,njk->nik", frame, local * REFLECT[:, None])
    poses = np.concatenate([matrix_to_quaternion(axes), point(column("c"))], axis=-1)
    return {
        "poses": poses,
        "axes": axes,
        "width": column("crown_width_mm"),
        "depth": column("crown_depth_mm"),
        "cusp_tip": point(column("cusp_tip")),
        "buccal_point": point(column("buccal_point")),
    }


def _touching_widths(poses: np.ndarray, width: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """The measured widths, each reduced (by half the deepest overlap of its contacts, repeatedly) until
    no two neighbouring ellipses overlap: the widths of the collision model's crowns for this jaw."""
    w = width.copy()
    for _ in range(100):
        over = np.maximum(penetration_mm(poses, w, depth), 0.0)
        if not over.any():
            break
        cut = np.zeros_like(w)
        np.maximum.at(cut, CONTACT_CROWNS[0], over)
        np.maximum.at(cut, CONTACT_CROWNS[1], over)
        w -= 0.5 * cut + 1e-4 * (cut > 0)
    return w


@pytest.fixture(scope="module")
def jaw() -> dict:
    return real_jaw()


@pytest.fixture(scope="module")
def generated_targets() -> np.ndarray:
    return np.stack([generate_case(task, seed).target for task in TASK_IDS for seed in range(50)])


def test_the_conversion_is_rigid_and_in_the_project_convention(jaw):
    """Distances between crown centres are the CBCT's; crown frames are rotations and the quaternions
    give them back; upper crowns above the occlusal plane, left crowns at +x, incisors in front; each
    crown's axes within 35 degrees of the generated ideal arch's (same convention, another patient)."""
    teeth = json.loads(FIXTURE.read_text())["teeth"]
    cbct = np.array([teeth[str(t)]["c"] for t in TOOTH_IDS])
    p = jaw["poses"]
    dist = np.linalg.norm(p[:, None, 4:] - p[None, :, 4:], axis=-1)
    assert np.allclose(dist, np.linalg.norm(cbct[:, None] - cbct[None], axis=-1), atol=1e-9)
    assert np.allclose(np.linalg.det(jaw["axes"]), 1.0, atol=1e-6)
    for k in range(3):
        assert np.allclose(quaternion_axis(p[:, :4], k), jaw["axes"][..., k], atol=1e-6)
    assert np.all(p[IS_UPPER, 6] > 0) and np.all(p[~IS_UPPER, 6] < 0)
    assert np.all(np.sign(p[:, 4]) == SIDE)
    assert np.abs(p[UPPER_PAIRS[0], 5]).max() < 0.5 and np.all(p[:, 5] < 1.0)
    ideal = build_ideal_arch(ArchParameters()).poses
    for k in range(3):
        cos = np.sum(quaternion_axis(p[:, :4], k) * quaternion_axis(ideal[:, :4], k), axis=-1)
        assert np.degrees(np.arccos(np.clip(cos, -1.0, 1.0))).max() < 35.0, k


def test_arch_width_norms_hold_at_their_landmarks_not_at_the_centroids(jaw, generated_targets):
    """The generated targets' widths equal the norms at the landmarks (median of 50 seeds per level).
    This jaw's landmarks (the meshes' canine cusp tips and first molars' buccal points) lie outward of
    their crown centroids, along the labial direction, by the model's offsets within 0.5 mm (the molars'
    offsets are half Wheeler's diameters; the canines' were measured on this jaw). So the generated
    targets are as far from this jaw at the centroids as this jaw is from the norms at the landmarks,
    within one SD of the norm; with the norms at the centroids they were 6.9 / 3.6 / 9.9 / 9.7 mm wider
    (upper and lower intercanine, upper and lower intermolar)."""
    landmark = arch_widths_mm(generated_targets)
    centroid = centroid_widths_mm(generated_targets)
    real_centroid = centroid_widths_mm(jaw["poses"])
    marks = np.stack(
        [
            jaw["cusp_tip"][WIDTH_TEETH[0]],
            jaw["cusp_tip"][WIDTH_TEETH[1]],
            jaw["buccal_point"][WIDTH_TEETH[2]],
            jaw["buccal_point"][WIDTH_TEETH[3]],
        ]
    )  # (4, 2, 3): width, side (right, left)
    labial = jaw["axes"][WIDTH_TEETH][..., :2, 1]
    labial /= np.linalg.norm(labial, axis=-1, keepdims=True)
    offset = np.einsum("wsk,wsk->ws", marks[..., :2] - jaw["poses"][WIDTH_TEETH][..., 4:6], labial).mean(-1)
    real_landmark = np.abs(marks[:, 1, 0] - marks[:, 0, 0])
    report = {}
    for k, name in enumerate(WIDTH_NAMES):
        mean, sd = NORMS[k]
        gen_landmark, gen_centroid = float(np.median(landmark[name])), float(np.median(centroid[name]))
        report[name] = (round(gen_landmark, 1), round(gen_centroid, 1), round(float(real_centroid[name]), 1))
        assert gen_landmark == pytest.approx(mean, abs=0.5), (name, report[name])
        assert offset[k] == pytest.approx(OFFSETS[k], abs=0.5), (name, offset[k])
        assert gen_centroid < mean - 1.2 * OFFSETS[k], (name, report[name])
        excess = abs(gen_centroid - float(real_centroid[name])) - abs(mean - real_landmark[k])
        assert excess <= sd, (name, report[name], real_landmark[k])


def _record(jaw: dict, width: np.ndarray) -> dict:
    poses = jaw["poses"].tolist()
    return {
        "format": FORMAT,
        "case_id": "open-full-jaw-26",
        "patient_id": "open-full-jaw-26",
        "teeth": list(TOOTH_IDS),
        "initial": poses,
        "target": poses,
        "crown_width_mm": width.tolist(),
        "crown_depth_mm": jaw["depth"].tolist(),
        "labels": {"profile": "mild_irregularity", "notes": "Open-Full-Jaw Patient 26 at rest"},
    }


def test_the_real_jaw_at_rest_breaks_no_hard_rule(jaw):
    """With the measured crown sizes, no crowns one apart meet and the neighbours overlap by at most
    0.6 mm as ellipses (four contacts beyond the tolerance, see the module docstring); with the widths
    that make the ellipses touch, at most 14 % below the measured ones, the case imports with no problem
    and nothing filled in."""
    p, w, d = jaw["poses"], jaw["width"], jaw["depth"]
    assert second_neighbour_penetration_mm(p, w, d).max() < -2.0
    measured = penetration_mm(p, w, d)
    assert measured.max() < 0.6, measured.max()
    touching = _touching_widths(p, w, d)
    assert penetration_mm(p, touching, d).max() <= 0.0
    assert np.all(touching <= w) and np.all(touching >= 0.86 * w), (touching / w).round(3)
    checked = case_of_record(_record(jaw, touching))
    assert checked.case is not None and not checked.problems and not checked.notes, checked.problems
    assert penetration_mm(checked.case.target, touching, d).max() <= COLLISION_TOLERANCE_MM


def test_the_real_jaw_has_an_ideal_anterior_bite_in_the_model(jaw):
    """The model's incisal points on this jaw: overjet, overbite and curve of Spee within the ideals
    (ABO; Andrews 1972): the anterior norms read a normal bite as normal."""
    p = jaw["poses"]
    assert IDEAL_OVERJET_MM[0] <= float(overjet_mm(p)) <= IDEAL_OVERJET_MM[1]
    assert IDEAL_OVERBITE_MM[0] <= float(overbite_mm(p)) <= IDEAL_OVERBITE_MM[1]
    assert 0.0 <= float(curve_of_spee_mm(p)) <= MAX_CURVE_OF_SPEE_MM


def test_doing_nothing_on_the_real_jaw_scores_as_on_an_ideal_arch(jaw):
    """The do-nothing plan through the environment's scoring: no hard rule broken, every component as on
    a generated ideal arch (its target as initial), the occlusion composite excepted (this patient's own
    bite, a Class III molar relation on the left: 0.82), and the reward lower by exactly its share."""
    case = case_of_record(_record(jaw, _touching_widths(jaw["poses"], jaw["width"], jaw["depth"]))).case
    generated = generate_case("task_easy", 0)
    ideal = replace(generated, initial=generated.target)
    real, reference = score_plans([DO_NOTHING, DO_NOTHING], [case, ideal])
    assert real["broken_rules"] == [] == reference["broken_rules"]
    for name, value in reference["diagnostics"].items():
        if name != "scaled_reward":
            assert real["diagnostics"][name] == pytest.approx(value, abs=1e-6), name
    occlusion = real["reward_breakdown"]["occlusion_composite"]
    for name, value in reference["reward_breakdown"].items():
        if name != "occlusion_composite":
            assert real["reward_breakdown"][name] == pytest.approx(value, abs=1e-4), name
    assert reference["reward_breakdown"]["occlusion_composite"] == pytest.approx(1.0, abs=1e-9)
    assert 0.8 < occlusion < 1.0
    # terminal = (multiplier / 1.2) * accuracy * (0.30 + 0.20 occlusion + ...): only occlusion differs
    share = reference["reward_breakdown"]["strategy_multiplier"] / 1.2 * 0.20 * (1.0 - occlusion)
    assert real["terminal_reward"] == pytest.approx(reference["terminal_reward"] - share, abs=1e-3)


def test_the_real_jaw_is_diagnosed_as_needing_no_treatment(jaw):
    """Its arrangement as both initial and target: the diagnosis from the geometry finds nothing to do."""
    from server.diagnosis import diagnose

    width = _touching_widths(jaw["poses"], jaw["width"], jaw["depth"])
    found = diagnose(jaw["poses"], jaw["poses"], width)
    assert not found.treatment_needed, found
    assert max(found.grades) == 0.0, found
