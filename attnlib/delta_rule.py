"""The delta rule and the gated delta rule: a matrix state that overwrites instead of adding.

Vectors are rows, as everywhere in the book: the state Omega is [D, Dv] and a key k reads
k Omega. The delta rule (eq. 25.8) is one step of gradient descent on |k Omega - v|^2 / 2
with step eta (transformers' `beta`, the argument's name here); the gated delta rule
(eq. 25.9) first multiplies the state by a decay alpha in (0, 1] (Gated DeltaNet, Yang,
Kautz and Hatamizadeh, 2024). The chunked form (eq. 25.10) solves
each chunk's writes with one triangular system. Shapes: q, k [B, H, T, D], v [B, H, T, Dv],
alpha and beta (eta) [B, H, T]; the output is [B, H, T, Dv] and the final state [B, H, D, Dv].
The queries are used as given: scale them (and normalise the keys) before the call.
"""

import torch


def _state(q, v, initial_state):
    b, h, _, d = q.shape
    if initial_state is None:
        return q.new_zeros(b, h, d, v.shape[-1])
    return initial_state.to(q.dtype)


def gated_delta_rule_recurrent(q, k, v, alpha, beta, initial_state=None):
    """Eq. (25.9), one token at a time: Omega_i = alpha_i Omega_{i-1}, then
    Omega_i += beta_i k_i^T (v_i - k_i Omega_i), then O_i = q_i Omega_i.
    Returns (O, final Omega)."""
    state = _state(q, v, initial_state)
    out = []
    for i in range(q.shape[2]):
        state = alpha[:, :, i, None, None] * state  # decay first
        k_i = k[:, :, i]  # [B, H, D]
        read = (k_i[..., None] * state).sum(-2)  # k_i Omega, [B, H, Dv]
        write = beta[:, :, i, None] * (v[:, :, i] - read)  # the correction, [B, H, Dv]
        state = state + k_i[..., None] * write[..., None, :]
        out.append((q[:, :, i, :, None] * state).sum(-2))  # read after the write
    return torch.stack(out, dim=2), state


def delta_rule_recurrent(q, k, v, beta, initial_state=None):
    """Eq. (25.8): the delta rule, Omega_i = Omega_{i-1} + beta_i k_i^T (v_i - k_i Omega_{i-1}),
    O_i = q_i Omega_i; eq. (25.9) with alpha = 1. Returns (O, final Omega)."""
    return gated_delta_rule_recurrent(q, k, v, torch.ones_like(beta), beta, initial_state)


def gated_delta_rule_chunked(q, k, v, alpha, beta, chunk: int = 64, initial_state=None):
    """Eq. (25.10). In a chunk with cumulative log-decays g_r = sum_{s<=r} log alpha_s and
    entering state Omega_0, the writes w_r = beta_r (v_r - k_r Omega_{r-1}) solve the unit lower
    triangular system (I + L) W = diag(beta) (V - diag(e^g) K Omega_0), with
    L_rs = beta_r e^{g_r - g_s} k_r.k_s for s < r; then
    O_r = e^{g_r} q_r Omega_0 + sum_{s<=r} e^{g_r - g_s} (q_r.k_s) w_s and
    Omega_c = e^{g_c} Omega_0 + sum_s e^{g_c - g_s} k_s^T w_s. Returns (O, final Omega)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    state = _state(q, v, initial_state)
    out = []
    for start in range(0, q.shape[2], chunk):
        qc, kc, vc = (x[:, :, start : start + chunk] for x in (q, k, v))
        g = torch.log(alpha[:, :, start : start + chunk]).cumsum(-1)  # [B, H, c]
        bc = beta[:, :, start : start + chunk, None]  # [B, H, c, 1]
        c = qc.shape[2]
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        gap = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, -torch.inf)
        decay = gap.exp()  # e^{g_r - g_s} for s <= r, else 0: [B, H, c, c]
        system = bc * (kc @ kc.transpose(-2, -1)) * decay.tril(-1)
        system = system + torch.eye(c, dtype=q.dtype, device=q.device)
        rhs = bc * (vc - g.exp()[..., None] * (kc @ state))
        writes = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out.append(g.exp()[..., None] * (qc @ state) + (qc @ kc.transpose(-2, -1) * decay) @ writes)
        to_end = (g[..., -1:] - g).exp()[..., None]  # e^{g_c - g_s}, [B, H, c, 1]
        state = g[..., -1, None, None].exp() * state + (kc * to_end).transpose(-2, -1) @ writes
    return torch.cat(out, dim=2), state


def delta_rule_chunked(q, k, v, beta, chunk: int = 64, initial_state=None):
    """Eq. (25.8) in chunks: eq. (25.10) with alpha = 1. Returns (O, final Omega)."""
    return gated_delta_rule_chunked(q, k, v, torch.ones_like(beta), beta, chunk, initial_state)
