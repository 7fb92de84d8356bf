"""Vectorised unit-quaternion algebra, w first: ``q = [w, x, y, z]``.

Every function takes arrays of shape ``(..., 4)`` (rotation vectors ``(..., 3)``)
and broadcasts over the leading axes, so a whole batch of plans x stages x teeth
is one call. Angles are radians unless a name says ``_deg``.
"""

from __future__ import annotations

import numpy as np

try:  # np.einsum without its Python wrapper (dispatch and argument checks: most of its cost here)
    from numpy._core.multiarray import c_einsum as _einsum
except ImportError:  # pragma: no cover - other numpy layouts
    _einsum = np.einsum

_EPS = 1e-12


def stack_components(parts: tuple[np.ndarray, ...] | list[np.ndarray]) -> np.ndarray:
    """``np.stack(parts, axis=-1)`` of k float arrays of one shape (...): a C-ordered (..., k) float64
    array, filled component by component (np.stack's Python overhead is most of its cost on the
    small arrays of the hot path)."""
    first = np.asarray(parts[0])
    out = np.empty((*first.shape, len(parts)))
    for i, part in enumerate(parts):
        out[..., i] = part
    return out


def dot_last(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dot product over the last axis, (..., n) x (..., n) -> (...): ``np.einsum("...i,...i->...")``,
    the same numbers, without the wrapper's overhead (the stepwise hot path)."""
    return _einsum("...i,...i->...", a, b)


def vector_norm(v: np.ndarray) -> np.ndarray:
    """Euclidean norm over the last axis, (..., n) -> (...) (np.linalg.norm's overhead is
    most of its cost on the small arrays of the hot path)."""
    return np.sqrt(_einsum("...i,...i->...", v, v))


def quaternion_normalize(q: np.ndarray) -> np.ndarray:
    """Unit quaternion(s) with a non-negative w (the same rotation, one sign)."""
    q = np.asarray(q, dtype=np.float64)
    n = vector_norm(q)[..., None]
    q = q / np.maximum(n, _EPS)
    negative = q[..., :1] < 0.0
    return np.where(negative, -q, q) if np.count_nonzero(negative) else q


def quaternion_multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton product ``a * b`` (apply b, then a).

    Up to SMALL_BATCH quaternions go through one (4 x 4) left-multiplication matrix
    product each (three numpy calls: the stepwise hot path is call overhead); larger
    batches component-wise (less memory traffic). Both agree to rounding.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size <= 4 * SMALL_BATCH and b.size <= 4 * SMALL_BATCH:
        return (a[..., _LEFT_INDEX] * _LEFT_SIGN @ b[..., None])[..., 0]
    aw, ax, ay, az = a[..., 0], a[..., 1], a[..., 2], a[..., 3]
    bw, bx, by, bz = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    return stack_components(
        (
            aw * bw - ax * bx - ay * by - az * bz,
            aw * bx + ax * bw + ay * bz - az * by,
            aw * by - ax * bz + ay * bw + az * bx,
            aw * bz + ax * by - ay * bx + az * bw,
        )
    )


SMALL_BATCH: int = 1024
"""Quaternion count up to which quaternion_multiply uses the matrix form (measured crossover
about 1,300 on one core)."""
_LEFT_INDEX = np.array([[0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 0, 1], [3, 2, 1, 0]])
_LEFT_SIGN = np.array([[1, -1, -1, -1], [1, 1, -1, 1], [1, 1, 1, -1], [1, -1, 1, 1]], dtype=np.float64)
"""``L(a) = a[_LEFT_INDEX] * _LEFT_SIGN`` is the matrix with ``a * b = L(a) @ b``."""


def quaternion_inverse_multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``quaternion_multiply(quaternion_inverse(a), b)`` for unit ``a``: the rotation from ``a`` to
    ``b`` in ``a``'s frame. Up to SMALL_BATCH quaternions the conjugation is folded into the
    product's matrix (signs only: the same numbers)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size <= 4 * SMALL_BATCH and b.size <= 4 * SMALL_BATCH:
        return (a[..., _LEFT_INDEX] * _CONJUGATE_LEFT_SIGN @ b[..., None])[..., 0]
    return quaternion_multiply(quaternion_inverse(a), b)


def quaternion_inverse(q: np.ndarray) -> np.ndarray:
    """Inverse of unit quaternion(s): the conjugate."""
    q = np.asarray(q, dtype=np.float64)
    return q * _CONJUGATE


_CONJUGATE = np.array([1.0, -1.0, -1.0, -1.0])
_CONJUGATE_LEFT_SIGN = _CONJUGATE[_LEFT_INDEX] * _LEFT_SIGN
"""``L(conj(a)) = a[_LEFT_INDEX] * _CONJUGATE_LEFT_SIGN``."""


def quaternion_angle(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rotation angle (rad, in [0, pi]) between unit quaternions a and b.

    Uses ``4 arcsin(|a - b| / 2)`` with b sign-aligned with a (``|a - b| = 2 sin(angle / 4)``),
    exact near 0 where ``2 arccos(|a.b|)`` loses half the digits. The aligned sign is the one
    giving the smaller of ``|a - b|`` and ``|a + b|``, so no dot product is needed.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size <= 4 * SMALL_BATCH and b.size <= 4 * SMALL_BATCH:  # one array, one einsum: fewer calls
        ds = a[..., None, :] + b[..., None, :] * _MINUS_PLUS  # (..., 2, 4): a - b, a + b
        chord2 = _einsum("...i,...i->...", ds, ds)
        chord2 = np.minimum(chord2[..., 0], chord2[..., 1])
    else:  # (broadcasting the signs over four components is slow on big batches)
        d = a - b
        s = a + b
        chord2 = np.minimum(_einsum("...i,...i->...", d, d), _einsum("...i,...i->...", s, s))
    return 4.0 * np.arcsin(np.minimum(0.5 * np.sqrt(chord2), 1.0))


_MINUS_PLUS = np.array([[-1.0], [1.0]])


def quaternion_slerp(q0: np.ndarray, q1: np.ndarray, t: np.ndarray | float) -> np.ndarray:
    """Spherical interpolation from q0 (t=0) to q1 (t=1) along the shorter arc.

    ``t`` broadcasts against the leading axes of q0/q1 (``t[..., None]`` is applied).
    """
    w0, w1, q0, q1 = _slerp_weights(q0, q1, t)
    if w0.size <= SMALL_BATCH:  # few quaternions: blended whole (fewer calls)
        return quaternion_normalize(w0 * q0 + w1 * q1)
    qc = _blend_components(w0, w1, q0, q1)
    out = np.empty((*qc.shape[1:], 4))
    out[...] = np.moveaxis(qc, 0, -1)
    return out


def slerp_components(q0: np.ndarray, q1: np.ndarray, t: np.ndarray | float) -> np.ndarray:
    """:func:`quaternion_slerp`, component-major: a C-ordered (4, ...) array (w, x, y, z planes)."""
    w0, w1, q0, q1 = _slerp_weights(q0, q1, t)
    if w0.size <= SMALL_BATCH:
        return components(quaternion_normalize(w0 * q0 + w1 * q1))
    return _blend_components(w0, w1, q0, q1)


def _slerp_weights(
    q0: np.ndarray, q1: np.ndarray, t: np.ndarray | float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """SLERP's weights of q0 and q1, (..., 1) each, and the two quaternions (q1 sign-aligned with q0)."""
    q0 = np.asarray(q0, dtype=np.float64)
    q1 = np.asarray(q1, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)[..., None]
    dot = np.add.reduce(q0 * q1, axis=-1, keepdims=True)
    opposite = dot < 0.0
    if np.count_nonzero(opposite):
        q1 = np.where(opposite, -q1, q1)
    dot = np.minimum(np.abs(dot), 1.0)  # clip(|dot|, 0, 1)
    theta = np.arccos(dot)
    sin_theta = np.sin(theta)
    small = sin_theta < 1e-6
    u = 1.0 - t
    if np.count_nonzero(small):
        safe = np.where(small, 1.0, sin_theta)
        w0 = np.where(small, u, np.sin(u * theta) / safe)
        w1 = np.where(small, t, np.sin(t * theta) / safe)
    else:
        w0, w1 = np.sin(u * theta) / sin_theta, np.sin(t * theta) / sin_theta
    return w0, w1, q0, q1


def _blend_components(w0: np.ndarray, w1: np.ndarray, q0: np.ndarray, q1: np.ndarray) -> np.ndarray:
    """``quaternion_normalize(w0 * q0 + w1 * q1)`` with its arithmetic, component-major (4, ...): the
    weights broadcast over long inner loops instead of over the quaternions' four components
    (what makes big batches slow)."""
    w0, w1 = w0[None, ..., 0], w1[None, ..., 0]
    q = w0 * components(q0) + w1 * components(q1)
    q = q / np.maximum(np.sqrt(_norm2(q)), _EPS)
    if np.count_nonzero(q[0] < 0.0):
        q = np.where(q[0] < 0.0, -q, q)
    return q


def components(v: np.ndarray) -> np.ndarray:
    """A C-ordered copy of vectors (..., n) component-major: (n, ...)."""
    return np.ascontiguousarray(np.moveaxis(v, -1, 0))


def pose_distances(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Translation (mm) and rotation (rad) between poses given component-major, (7, ...) each
    (:func:`components` of (..., 7) poses): ``vector_norm`` of the translations' difference and
    ``quaternion_angle`` of the rotations, with their arithmetic (the squared norms summed in the
    order their einsum adds contiguous components), plane by plane: fast on big batches."""
    dt = a[4:] - b[4:]
    t = np.sqrt(_norm2_3(dt))
    chord2 = np.minimum(_norm2(a[:4] - b[:4]), _norm2(a[:4] + b[:4]))
    return t, 4.0 * np.arcsin(np.minimum(0.5 * np.sqrt(chord2), 1.0))


def _norm2_3(v: np.ndarray) -> np.ndarray:
    """Squared norm of 3-vectors stored component-major (3, ...), in the order :func:`vector_norm`'s
    einsum adds three contiguous components: ``(x^2 + z^2) + y^2``."""
    x, y, z = v
    return (x * x + z * z) + y * y


def _norm2(q: np.ndarray) -> np.ndarray:
    """Squared norm of quaternions stored component-major (4, ...): the sum in the order
    :func:`vector_norm`'s einsum adds four contiguous components, ``(w^2 + y^2) + (x^2 + z^2)``."""
    w, x, y, z = q
    return (w * w + y * y) + (x * x + z * z)


def quaternion_from_rotvec(v: np.ndarray) -> np.ndarray:
    """Quaternion of rotation vector(s) ``v`` (axis times angle, rad)."""
    v = np.asarray(v, dtype=np.float64)
    angle = vector_norm(v)[..., None]
    half = 0.5 * angle
    # sin(a/2)/a -> 1/2 as a -> 0 (the next term, a^2/48, is below double precision for a < 1e-8)
    k = np.where(angle < 1e-8, 0.5, np.sin(half) / np.maximum(angle, _EPS))
    return np.concatenate((np.cos(half), k * v), axis=-1)


def quaternion_to_rotvec(q: np.ndarray) -> np.ndarray:
    """Rotation vector(s) (axis times angle, rad, angle in [0, pi]) of quaternion(s) ``q``.

    Scale-free (``atan2(|v|, |w|)`` and ``v / |v|`` do not depend on ``|q|``), so ``q`` need
    not be normalised first; a zero quaternion gives the zero vector.
    """
    q = np.asarray(q, dtype=np.float64)
    w = q[..., 0]
    v = q[..., 1:]
    s = vector_norm(v)
    aw = np.abs(w)
    # small angles: angle / |v| -> 2 / |w|; q and -q are one rotation, so v takes w's sign
    k = np.where(s < 1e-8 * aw, 2.0 / np.maximum(aw, _EPS), 2.0 * np.arctan2(s, aw) / np.maximum(s, _EPS))
    return np.copysign(k, w)[..., None] * v


def quaternion_rotate(q: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Rotate vector(s) ``v`` (..., 3) by unit quaternion(s) ``q`` (..., 4)."""
    q = np.asarray(q, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    w = q[..., :1]
    u = q[..., 1:]
    t = 2.0 * _cross(u, v)
    return v + w * t + _cross(u, t)


def quaternion_axis(q: np.ndarray, k: int) -> np.ndarray:
    """(..., 3) the rotated unit axis ``k`` (0 = x, 1 = y, 2 = z) of unit quaternion(s) ``q``."""
    q = np.asarray(q, dtype=np.float64)
    w, x, y, z = q[..., 0], q[..., 1], q[..., 2], q[..., 3]
    if k == 0:
        row = (1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y + w * z), 2.0 * (x * z - w * y))
    elif k == 1:
        row = (2.0 * (x * y - w * z), 1.0 - 2.0 * (x * x + z * z), 2.0 * (y * z + w * x))
    else:
        row = (2.0 * (x * z + w * y), 2.0 * (y * z - w * x), 1.0 - 2.0 * (x * x + y * y))
    return stack_components(row)


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.cross for (..., 3) arrays without its axis bookkeeping (hot path)."""
    a0, a1, a2 = a[..., 0], a[..., 1], a[..., 2]
    b0, b1, b2 = b[..., 0], b[..., 1], b[..., 2]
    return stack_components((a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0))


def quaternion_about_axis(axis: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """Quaternion(s) for a rotation of ``angle`` (rad) about unit ``axis``."""
    return quaternion_from_rotvec(np.asarray(axis, dtype=np.float64) * np.asarray(angle)[..., None])


def quaternion_from_matrix(m: np.ndarray) -> np.ndarray:
    """Unit quaternion(s) (..., 4), w first and w >= 0, of rotation matrices ``m`` (..., 3, 3).

    The inverse of :func:`quaternion_axis`: column ``k`` of ``m`` is the rotated axis ``k``. Shepperd's
    method (J. Guidance Control 1:223, 1978): the largest of the four diagonal combinations is taken
    as the pivot, so no division comes near zero. ``m`` must be a rotation (orthonormal, det +1).
    """
    m = np.asarray(m, dtype=np.float64)
    m00, m01, m02 = m[..., 0, 0], m[..., 0, 1], m[..., 0, 2]
    m10, m11, m12 = m[..., 1, 0], m[..., 1, 1], m[..., 1, 2]
    m20, m21, m22 = m[..., 2, 0], m[..., 2, 1], m[..., 2, 2]
    pivots = np.stack(
        (1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22), -1
    )
    k = np.argmax(pivots, axis=-1)
    s = 2.0 * np.sqrt(
        np.maximum(np.take_along_axis(pivots, k[..., None], -1)[..., 0], _EPS)
    )  # 4 x pivot comp.
    a, b, c = m21 - m12, m02 - m20, m10 - m01  # 4 w x, 4 w y, 4 w z
    d, e, f = m01 + m10, m02 + m20, m12 + m21  # 4 x y, 4 x z, 4 y z
    q = np.select(
        [k[..., None] == i for i in range(4)],
        [
            np.stack((s / 4, a / s, b / s, c / s), -1),
            np.stack((a / s, s / 4, d / s, e / s), -1),
            np.stack((b / s, d / s, s / 4, f / s), -1),
            np.stack((c / s, e / s, f / s, s / 4), -1),
        ],
    )
    return np.where(q[..., :1] < 0.0, -q, q)


def quaternion_to_matrix(q: np.ndarray) -> np.ndarray:
    """Rotation matrices (..., 3, 3) of unit quaternion(s) ``q`` (..., 4): columns the rotated axes."""
    return np.stack([quaternion_axis(q, k) for k in range(3)], axis=-1)
