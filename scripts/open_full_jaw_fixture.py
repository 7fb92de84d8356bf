"""Derive the real-jaw fixture ``tests/data/open_full_jaw_patient26.json`` from Open-Full-Jaw.

Open-Full-Jaw (github.com/diku-dk/Open-Full-Jaw; Gholamalizadeh et al., Computer Methods and Programs
in Biomedicine 2022) publishes CBCT-segmented jaws. At commit a74d4c4 (June 2022, MIT licence; the
repository was relicensed CC BY-NC-SA 4.0 in July 2022 and its patients re-packed) Patient 26 comes
with ``input/{maxilla,mandible}/teeth_axes_*.json`` (per tooth, Universal numbering: the crown's centre
of mass ``c`` and the end points, 1 mm out, of its ``x``, ``y``, ``z`` axes) and the teeth's surface
meshes ``input/*/teeth/tooth_<n>.stl``. This script keeps the 28 teeth the project models (no third
molars): their centres and unit axes as published, in the CBCT frame (mm), and a few measurements
of each crown mesh, in the same frame:

* ``crown_width_mm``: mesiodistal width, between the crown's extreme points along its ``x`` axis (its
  contact points);
* ``crown_depth_mm``: buccolingual depth at the contact level, the extent along ``y`` of the crown within
  1 mm (along ``z``) of the contact points' mean height (the project's crown depth is taken there);
* ``cusp_tip``: the crown's point farthest along ``z`` (the axis points to the incisal / occlusal end);
* ``buccal_point``: the crown's point farthest along ``y`` projected on the occlusal plane (the plane
  fitted through the 28 centres), the height of contour an arch width across the buccal surfaces is
  measured at.

"The crown" is the part of the mesh from 1 mm apical of the centre along ``z`` to the occlusal end.
Usage (a clone or bare mirror of the repository)::

    python scripts/open_full_jaw_fixture.py --git-dir Open-Full-Jaw/.git --out tests/data/open_full_jaw_patient26.json
"""

from __future__ import annotations

import argparse
import json
import subprocess

import numpy as np

COMMIT = "a74d4c44b5aeac450c55012ab0bdb73fc5963217"
PATIENT = "dataset/Patient_26/input"
CROWN_FROM_MM = -1.0
"""The crown: mesh points from this far along ``z`` (apical when negative) of the centre."""
CONTACT_BAND_MM = 1.0


def universal_to_fdi(u: int) -> int:
    """FDI id of a Universal tooth number (1 upper right third molar ... 32 lower right third molar)."""
    quadrant, number = (
        (1, 9 - u) if u <= 8 else (2, u - 8) if u <= 16 else (3, 25 - u) if u <= 24 else (4, u - 24)
    )
    return 10 * quadrant + number


def _show(git_dir: str, path: str) -> bytes:
    return subprocess.run(
        ["git", "--git-dir", git_dir, "show", f"{COMMIT}:{path}"], check=True, capture_output=True
    ).stdout


def _stl_points(data: bytes) -> np.ndarray:
    """Unique vertices (n, 3) of a binary STL."""
    n = int(np.frombuffer(data, np.uint32, 1, 80)[0])
    tri = np.frombuffer(data, np.dtype([("n", "<f4", 3), ("v", "<f4", (3, 3)), ("a", "<u2")]), n, 84)
    return np.unique(tri["v"].reshape(-1, 3).astype(float), axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    teeth = {}
    for jaw in ("maxilla", "mandible"):
        for key, axes in json.loads(_show(args.git_dir, f"{PATIENT}/{jaw}/teeth_axes_{jaw}.json")).items():
            fdi = universal_to_fdi(int(key))
            if fdi % 10 <= 7:
                teeth[fdi] = {"universal": int(key), "jaw": jaw, **axes}
    fdis = sorted(teeth)
    centre = np.array([teeth[t]["c"] for t in fdis])
    axes = {a: np.array([teeth[t][a] for t in fdis]) - centre for a in "xyz"}
    # the occlusal plane through the centres: its normal from the lower towards the upper crowns
    normal = np.linalg.svd(centre - centre.mean(0))[2][2]
    upper = np.array([t // 10 <= 2 for t in fdis])
    if (centre[upper].mean(0) - centre.mean(0)) @ normal < 0:
        normal = -normal
    for k, t in enumerate(fdis):
        tooth = teeth[t]
        pts = _stl_points(
            _show(args.git_dir, f"{PATIENT}/{tooth['jaw']}/teeth/tooth_{tooth['universal']}.stl")
        )
        local = (pts - centre[k]) @ np.stack([axes[a][k] for a in "xyz"]).T  # (n, 3) along x, y, z
        crown = pts[local[:, 2] > CROWN_FROM_MM]
        lc = local[local[:, 2] > CROWN_FROM_MM]
        a, b = np.argmin(lc[:, 0]), np.argmax(lc[:, 0])
        level = (lc[a, 2] + lc[b, 2]) / 2
        band = np.abs(lc[:, 2] - level) <= CONTACT_BAND_MM
        labial = axes["y"][k] - (axes["y"][k] @ normal) * normal
        tooth.update(
            crown_width_mm=round(float(lc[b, 0] - lc[a, 0]), 3),
            crown_depth_mm=round(float(np.ptp(lc[band, 1])), 3),
            cusp_tip=np.round(crown[np.argmax(lc[:, 2])], 3).tolist(),
            buccal_point=np.round(crown[np.argmax((crown - centre[k]) @ labial)], 3).tolist(),
        )
    out = {
        "source": f"https://github.com/diku-dk/Open-Full-Jaw/tree/{COMMIT}/{PATIENT}",
        "licence": "MIT, Copyright (c) 2022 Torkan Gholamalizadeh (the repository's licence at this commit; "
        "relicensed CC BY-NC-SA 4.0 from July 2022)",
        "citation": "Gholamalizadeh T. et al., Open-Full-Jaw: an open-access dataset and pipeline for finite "
        "element models of human jaw, Computer Methods and Programs in Biomedicine 224 (2022) 107009",
        "derived_by": "scripts/open_full_jaw_fixture.py (see its docstring for each field)",
        "frame": "the CBCT frame of the dataset, mm: x towards the patient's left, y posterior, z superior",
        "axes": "c: crown centre of mass; x, y, z: unit axes as published (end point minus c): x mesiodistal "
        "(pointing distally), y labial/buccal, z long axis (pointing to the incisal / occlusal end)",
        "teeth": {
            str(t): {
                "universal": teeth[t]["universal"],
                "c": np.round(centre[k], 3).tolist(),
                **{a: np.round(axes[a][k], 6).tolist() for a in "xyz"},
                **{f: teeth[t][f] for f in ("crown_width_mm", "crown_depth_mm", "cusp_tip", "buccal_point")},
            }
            for k, t in enumerate(fdis)
        },
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
