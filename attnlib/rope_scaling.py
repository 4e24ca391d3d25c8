"""RoPE past its training length, chapter 24: each rule rescales the frequencies of eq. 8.3.

A model trained on T_train tokens has seen every pair f turn through at most T_train * theta_f
radians. To read T tokens, `factor` = T/T_train times further, a rule changes theta_f
(eqs. 24.1-24.4):

* position interpolation ("linear"): theta_f / factor for every pair (eq. 24.1);
* NTK-aware ("dynamic" in Hugging Face): a larger base, Theta * factor**(D/(D-2)) (eq. 24.2);
* YaRN: pairs that turn many times in T_train are kept, slow ones interpolated, a linear ramp
  between, and a temperature on the scores (eq. 24.3);
* Llama 3: the same split by wavelength, with a ramp in 1/wavelength (eq. 24.4).

Each function returns (inverse frequencies [D/2] float32, attention factor), the pair that
transformers' `ROPE_INIT_FUNCTIONS[rule](config)` returns; the attention factor multiplies
cos and sin, so it multiplies every score by its square.
"""

import math

import torch

from .rope import rope_frequencies


def _check_factor(factor: float) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ValueError(f"the factor T/T_train must be a number >= 1, got {factor!r}")
    return float(factor)


def linear_frequencies(head_dim: int, theta: float, factor: float):
    """Eq. 24.1, position interpolation: theta_f / factor: position p turns as p / factor did."""
    factor = _check_factor(factor)
    return rope_frequencies(head_dim, theta) / factor, 1.0


def ntk_base(head_dim: int, theta: float, factor: float) -> float:
    """Eq. 24.2, NTK-aware: the base Theta * factor**(D/(D-2)); the last pair slows by factor."""
    factor = _check_factor(factor)
    return theta * factor ** (head_dim / (head_dim - 2))


def dynamic_frequencies(
    head_dim: int, theta: float, factor: float, train_length: int, seq_len=None
):
    """Eq. 24.2 with Hugging Face's dynamic ratio factor * T/T_train - (factor - 1) in place of
    T/T_train, for T = max(seq_len, T_train) tokens: plain RoPE up to T_train."""
    factor = _check_factor(factor)
    length = train_length if seq_len is None else max(int(seq_len), train_length)
    effective = factor * length / train_length - (factor - 1)
    base = theta * effective ** (head_dim / (head_dim - 2))
    return rope_frequencies(head_dim, base), 1.0


def yarn_temperature_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1). It
    multiplies cos and sin, so the scores grow by its square: 1/tau (eq. 24.3)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_ramp_bounds(
    head_dim: int,
    theta: float,
    train_length: int,
    fast: float = 32,
    slow: float = 1,
    truncate: bool = True,
):
    """The pair indices where the ramp of eq. 24.3 starts and ends: pair f turns
    T_train * theta_f / (2 pi) times over T_train; it is `fast` at the first bound, `slow` at
    the second. truncate rounds them outwards (floor, ceil), as the paper's code does."""

    def pair(turns):  # solve T_train * Theta**(-2f/D) / (2 pi) = turns for f
        return head_dim * math.log(train_length / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(fast), pair(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def yarn_ramp(head_dim: int, low: float, high: float) -> torch.Tensor:
    """keep_f of eq. 24.3 for each pair [D/2]: 1 below `low` (kept), 0 above `high`
    (interpolated), linear between."""
    if low == high:
        high += 0.001  # as the reference code does: a step, not a division by zero
    f = torch.arange(head_dim // 2, dtype=torch.float32)
    return 1 - ((f - low) / (high - low)).clamp(0, 1)


def yarn_frequencies(
    head_dim: int,
    theta: float,
    factor: float,
    train_length: int,
    fast: float = 32,
    slow: float = 1,
    truncate: bool = True,
    attention_factor=None,
):
    """Eq. 24.3, YaRN: theta_f' = keep_f theta_f + (1 - keep_f) theta_f / factor, and the
    attention factor of `yarn_temperature_factor` unless one is given."""
    factor = _check_factor(factor)
    inv_freq = rope_frequencies(head_dim, theta)
    low, high = yarn_ramp_bounds(head_dim, theta, train_length, fast, slow, truncate)
    keep = yarn_ramp(head_dim, low, high)
    scaled = inv_freq / factor * (1 - keep) + inv_freq * keep
    if attention_factor is None:
        attention_factor = yarn_temperature_factor(factor)
    return scaled, float(attention_factor)


def llama3_frequencies(
    head_dim: int,
    theta: float,
    factor: float,
    train_length: int,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
):
    """Eq. 24.4, Llama 3: a pair whose wavelength 2 pi/theta_f is under T_train/4 keeps its
    frequency, one over T_train is divided by factor, and between the two the frequency blends
    them with weight T_train/wavelength - 1 on the kept one (divided by 3, for 4 and 1)."""
    factor = _check_factor(factor)
    inv_freq = rope_frequencies(head_dim, theta)
    wavelength = 2 * math.pi / inv_freq
    long_bound = train_length / low_freq_factor
    short_bound = train_length / high_freq_factor
    out = torch.where(wavelength > long_bound, inv_freq / factor, inv_freq)
    smooth = (train_length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * out / factor + smooth * out
    middle = ~(wavelength < short_bound) & ~(wavelength > long_bound)
    return torch.where(middle, blended, out), 1.0


RULES = ("default", "linear", "dynamic", "yarn", "llama3")


def scaled_frequencies(rule: str, head_dim: int, theta: float = 10000.0, **options):
    """(inverse frequencies [D/2], attention factor) of one rule, by Hugging Face's name.

    options: factor (T/T_train), train_length (T_train), and the rule's own: seq_len (dynamic),
    fast, slow, truncate, attention_factor (yarn), low_freq_factor, high_freq_factor (llama3).
    """
    if rule == "default":
        return rope_frequencies(head_dim, theta), 1.0
    if rule == "linear":
        return linear_frequencies(head_dim, theta, options["factor"])
    functions = {
        "dynamic": dynamic_frequencies,
        "yarn": yarn_frequencies,
        "llama3": llama3_frequencies,
    }
    if rule not in functions:
        raise ValueError(f"unknown RoPE rule {rule!r}; known: {', '.join(RULES)}")
    return functions[rule](head_dim, theta, **options)


def scaled_cos_sin(positions, inv_freq: torch.Tensor, attention_factor: float = 1.0):
    """cos and sin of eq. 8.4 for integer positions [T] or [B, T] with any frequencies,
    each times the attention factor: [T, D] or [B, T, D], float32."""
    positions = torch.as_tensor(positions)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must hold integers, got {positions.dtype}")
    angles = positions[..., None].float() * inv_freq.to(positions.device)  # [..., T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [..., T, D]
    return angles.cos() * attention_factor, angles.sin() * attention_factor
