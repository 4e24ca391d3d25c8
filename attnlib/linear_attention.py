"""Causal linear attention in three forms: the masked T x T matrix, a recurrence, and chunks.

The softmax's similarity exp(q.k / sqrt(D)) is replaced by psi(q).psi(k) for a positive
feature map psi, keeping the normaliser (eq. 25.1). Because the similarity factorises, the
causal sums become running sums: a matrix state and a vector (eq. 25.2), which the chunked
form updates once per chunk (eq. 25.3). All three compute the same function; their costs
are eq. (25.4). Shapes: q, k [B, H, T, D], v [B, H, T, Dv], output [B, H, T, Dv].
"""

import torch
import torch.nn.functional as F


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """psi(x) = elu(x) + 1, positive (Katharopoulos et al., 2020); chapter 14's map."""
    return F.elu(x) + 1


def linear_attention_quadratic(q, k, v, feature_map=elu_feature_map):
    """Eq. (25.1): O_i = sum_{j<=i} (psi(q_i).psi(k_j)) v_j / sum_{j<=i} psi(q_i).psi(k_j),
    from the whole masked [T, T] matrix of similarities."""
    t = q.shape[-2]
    sim = feature_map(q) @ feature_map(k).transpose(-2, -1)  # [B, H, T, T]
    sim = sim * torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return sim @ v / sim.sum(-1, keepdim=True)


def linear_attention_recurrent(q, k, v, feature_map=elu_feature_map):
    """Eq. (25.2): the state Omega_i = Omega_{i-1} + psi(k_i)^T v_i [D, Dv] and the normaliser
    Psi_i = Psi_{i-1} + psi(k_i) [D], both written before token i reads them:
    O_i = psi(q_i) Omega_i / psi(q_i).n_i."""
    fq, fk = feature_map(q), feature_map(k)
    b, h, t, d = fq.shape
    state = q.new_zeros(b, h, d, v.shape[-1])  # Omega, [B, H, D, Dv]
    norm = q.new_zeros(b, h, d)  # Psi, [B, H, D]
    out = []
    for i in range(t):
        state = state + fk[:, :, i, :, None] * v[:, :, i, None, :]
        norm = norm + fk[:, :, i]
        num = (fq[:, :, i, :, None] * state).sum(-2)  # [B, H, Dv]
        out.append(num / (fq[:, :, i] * norm).sum(-1, keepdim=True))
    return torch.stack(out, dim=2)


def linear_attention_chunked(q, k, v, chunk: int = 64, feature_map=elu_feature_map):
    """Eq. (25.3): within a chunk the masked quadratic form, across chunks the state and
    normaliser of everything before it: O = (psi(Q_c) Omega + masked(psi(Q_c) psi(K_c)^T) V_c)
    / (psi(Q_c) Psi + row sums of the masked similarities)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    fq, fk = feature_map(q), feature_map(k)
    b, h, t, d = fq.shape
    state = q.new_zeros(b, h, d, v.shape[-1])
    norm = q.new_zeros(b, h, d, 1)
    out = []
    for start in range(0, t, chunk):
        qc, kc, vc = (x[:, :, start : start + chunk] for x in (fq, fk, v))
        sim = (qc @ kc.transpose(-2, -1)).tril()  # [B, H, c, c], causal within the chunk
        num = qc @ state + sim @ vc  # [B, H, c, Dv]
        den = qc @ norm + sim.sum(-1, keepdim=True)  # [B, H, c, 1]
        out.append(num / den)
        state = state + kc.transpose(-2, -1) @ vc  # the chunk's keys written at once
        norm = norm + kc.sum(-2)[..., None]
    return torch.cat(out, dim=2)


def linear_attention_flops(t: int, d: int, dv: int, form: str, chunk: int = 64) -> int:
    """Eq. (25.4), multiply-adds counted as 2 FLOPs, one head, numerator and normaliser:
    quadratic 2 T^2 (D + Dv) (masked half not skipped), recurrent 4 T D (Dv + 1),
    chunked 2 T c (D + Dv) + 4 T D (Dv + 1)."""
    if form == "quadratic":
        return 2 * t * t * (d + dv)
    if form == "recurrent":
        return 4 * t * d * (dv + 1)
    if form == "chunked":
        return 2 * t * chunk * (d + dv) + 4 * t * d * (dv + 1)
    raise ValueError(f"form must be 'quadratic', 'recurrent' or 'chunked', got {form!r}")


def decode_state_bytes(d: int, dv: int, bytes_per_number: int = 2) -> int:
    """Eq. (25.5): bytes of one head's recurrent state, D x Dv (plus the normaliser's D):
    the same at every length, unlike the KV cache's 2 S D nu of eq. (10.1)."""
    return (d * dv + d) * bytes_per_number


def crossover_length(d: int, dv: int) -> int:
    """Eq. (25.6): the first S at which one head's KV cache, S (D + Dv) numbers, exceeds the
    linear-attention state, D Dv + D numbers."""
    return (d * dv + d) // (d + dv) + 1
