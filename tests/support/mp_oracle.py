"""A dense 40-digit evaluation of attention's gradients (mpmath), for inputs where float64 formulas cancel."""

import itertools

import mpmath
import numpy as np


def mp_attention_grads(q, k, v, dout, scale, tau, beta, softcap=None, sigma=None, sharpness=1.0):
    """dq, dk, dv, dtau, dbeta, dsigma of one head, dense, in 40-digit arithmetic (no masks)."""
    with mpmath.workdps(40):
        return _grads(q, k, v, dout, scale, tau, beta, softcap, sigma, sharpness)


def _grads(q, k, v, dout, scale, tau, beta, softcap, sigma, sharpness):
    mp = mpmath.mp
    N, M = q.shape[0], k.shape[0]
    Q, K, V, dO = (mp.matrix(a.tolist()) for a in (q, k, v, dout))
    scale, tau, beta = mp.mpf(scale), mp.mpf(tau), mp.mpf(beta)
    raw = [[scale * sum(Q[i, d] * K[j, d] for d in range(q.shape[1])) for j in range(M)] for i in range(N)]
    cap_slope = [[mp.one] * M for _ in range(N)]
    s = [row[:] for row in raw]
    if softcap is not None:
        cap = mp.mpf(softcap)
        s = [[cap * mp.tanh(x / cap) for x in row] for row in raw]
        cap_slope = [[mp.sech(x / cap) ** 2 for x in row] for row in raw]
    z = [[s[i][j] / tau for j in range(M)] for i in range(N)]
    dlogg = [[mp.zero] * M for _ in range(N)]
    if sigma is not None:
        sig = mp.mpf(sigma)
        for i, j in itertools.product(range(N), range(M)):
            x = 2 * mp.mpf(j - i - (M - N)) / (M - 1) if M > 1 else mp.zero
            f = mp.exp(-(x**2) / (2 * sig**2)) / (sig * mp.sqrt(2 * mp.pi))
            y = sharpness * f
            z[i][j] += mp.log(mp.tanh(y))
            # d log tanh(y) / dy = sech^2 y / tanh y = 2 / sinh 2y
            dlogg[i][j] = 2 / mp.sinh(2 * y) * sharpness * f * (x**2 / sig**3 - 1 / sig)
    dq, dk = np.zeros(q.shape), np.zeros(k.shape)
    dv = np.zeros(v.shape)
    dk_mp = [[mp.zero] * k.shape[1] for _ in range(M)]
    dtau = dbeta = dsigma = mp.zero
    for i in range(N):
        lse = mp.log(sum(mp.exp(x) for x in z[i]) + beta)
        p = [mp.exp(x - lse) for x in z[i]]
        out = [sum(p[j] * V[j, d] for j in range(M)) for d in range(v.shape[1])]
        delta = sum(dO[i, d] * out[d] for d in range(v.shape[1]))
        dbeta -= delta * mp.exp(-lse)
        dq_i = [mp.zero] * q.shape[1]
        for j in range(M):
            dp = sum(dO[i, d] * V[j, d] for d in range(v.shape[1]))
            dz = p[j] * (dp - delta)
            dtau -= dz * s[i][j] / tau**2
            dsigma += dz * dlogg[i][j]
            ds_raw = dz / tau * cap_slope[i][j]
            for d in range(q.shape[1]):
                dq_i[d] += scale * ds_raw * K[j, d]
                dk_mp[j][d] += scale * ds_raw * Q[i, d]
            for d in range(v.shape[1]):
                dv[j, d] += float(p[j] * dO[i, d])
        dq[i] = [float(x) for x in dq_i]
    dk[:] = [[float(x) for x in row] for row in dk_mp]
    return dict(dq=dq, dk=dk, dv=dv, dtau=float(dtau), dbeta=float(dbeta), dsigma=float(dsigma))


def saturated_inputs(seed=0, N=3, M=5, D=4):
    """Scores ``q.k`` of both signs and sizes between 1.49 and 3, far from 0."""
    rng = np.random.default_rng(seed)
    q = rng.uniform(-0.01, 0.01, (N, D))
    k = rng.uniform(-0.01, 0.01, (M, D))
    q[:, 0] = rng.choice([-1.0, 1.0], N)
    k[:, 0] = rng.choice([-1.0, 1.0], M) * rng.uniform(1.5, 3.0, M)
    v = rng.standard_normal((M, D))
    dout = rng.standard_normal((N, D))
    return q, k, v, dout


def relative_errors(grads, want):
    """Each gradient's largest error relative to the largest magnitude of ``want``'s; inf for NaN."""
    errors = {}
    for name, ref in want.items():
        if getattr(grads, name) is None:
            continue
        got = np.asarray(getattr(grads, name), dtype=np.float64).reshape(np.shape(ref))
        scale = np.max(np.abs(ref))
        error = float(np.max(np.abs(got - ref)) / scale) if scale > 0 else float(np.max(np.abs(got)))
        errors[name] = np.inf if np.isnan(error) else error  # so that max(errors.values()) cannot skip it
    return errors
