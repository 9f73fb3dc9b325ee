"""RoPE as llama.cpp configures it: ggml's rope arguments, and the GGUF keys they come from.

ggml's rope (``rope_yarn`` in ggml-cpu/ops.cpp) turns pair ``i`` of a token at position ``p`` by::

    theta_extrap = p * base^(-2i/dims) / freq_factors[i]
    theta_interp = freq_scale * theta_extrap
    mix          = ramp(i) * ext_factor
    theta        = theta_interp * (1 - mix) + theta_extrap * mix

and multiplies cos and sin by ``attn_factor``, times ``1 + 0.1 ln(1/freq_scale)`` when ``ext_factor``
is not 0 (YaRN's magnitude correction). ``ramp(i)`` is 1 below YaRN's low correction dimension, 0
above its high one, linear in between (:func:`yarn_corr_dims`). Both parts map exactly onto a
:class:`~leat.backend.RopeSpec`: theta is ``theta_extrap`` times a per-pair factor, so the mix
becomes part of ``freq_factors``, and the magnitude is ``attn_factor``. Backends rotate plainly.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from leat.backend import RopeSpec
from leat.modelfile import ModelFile

K = gguf.Keys


def yarn_corr_dims(
    dims: int, orig_context: int, base: float, beta_fast: float, beta_slow: float
) -> tuple[float, float]:
    """YaRN's correction range ``(low, high)`` in pair indices, as ``ggml_rope_yarn_corr_dims``.

    ``corr_dim(r)`` is the dimension whose wavelength fits ``r`` rotations into ``orig_context``
    positions: ``dims * ln(orig_context / (2 pi r)) / (2 ln base)``; low is floored, high ceiled.
    """

    def corr_dim(rotations: float) -> float:
        return dims * math.log(orig_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr_dim(beta_fast))), min(dims - 1.0, math.ceil(corr_dim(beta_slow)))


def ggml_rope(
    dims: int,
    base: float,
    neox: bool,
    freq_scale: float = 1.0,
    ext_factor: float = 0.0,
    attn_factor: float = 1.0,
    orig_context: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    freq_factors: np.ndarray | None = None,
) -> RopeSpec:
    """The RopeSpec of ``ggml_rope_ext``'s arguments (same names, same meaning)."""
    if ext_factor == 0.0:
        return RopeSpec(dims, base, neox, freq_scale, freq_factors, attn_factor)
    low, high = yarn_corr_dims(dims, orig_context, base, beta_fast, beta_slow)
    pairs = np.arange(dims // 2, dtype=np.float64)
    ramp = 1.0 - np.clip((pairs - low) / max(0.001, high - low), 0.0, 1.0)
    mix = ramp * ext_factor
    factors = 1.0 / (freq_scale * (1.0 - mix) + mix)  # theta = theta_extrap / factors
    if freq_factors is not None:
        factors = factors * np.asarray(freq_factors, dtype=np.float64)[: dims // 2]
    magnitude = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    return RopeSpec(dims, base, neox, 1.0, factors, magnitude)


def rope_from_metadata(
    file: ModelFile, dims: int, neox: bool, base: float | None = None, freq_factors: np.ndarray | None = None
) -> RopeSpec:
    """A layer's RoPE from the file's ``rope.*`` keys, as llama.cpp's context setup derives ggml's arguments.

    Scaling type "none" or absent factor: plain RoPE; "linear": positions times 1/factor; "yarn":
    ``freq_scale`` 1/factor, ``ext_factor`` 1, ``orig_context`` from ``rope.scaling.original_context_length``
    (else the training context), beta_fast 32 and beta_slow 1 (llama.cpp's defaults; it reads no keys for
    them), and ``attn_factor`` such that the net magnitude is ``1 + 0.1 ln(factor)`` times
    ``rope.scaling.attn_factor``. ``base`` overrides ``rope.freq_base`` (e.g. a sliding-window layer's
    base). Architectures whose llama.cpp loader reads ``rope.scaling.yarn_log_multiplier`` (DeepSeek)
    derive ``attn_factor`` themselves and call :func:`ggml_rope`.
    """
    base = float(file.get(K.Rope.FREQ_BASE, 10000.0)) if base is None else base
    kind = str(file.get(K.Rope.SCALING_TYPE, "linear"))
    factor = float(file.get(K.Rope.SCALING_FACTOR, 0.0) or 0.0)
    freq_scale = 1.0 if kind == "none" or factor == 0.0 else 1.0 / factor
    attn_factor = float(file.get(K.Rope.SCALING_ATTN_FACTOR, 1.0))
    if kind != "yarn":
        return ggml_rope(dims, base, neox, freq_scale, attn_factor=attn_factor, freq_factors=freq_factors)
    scale = 1.0 / freq_scale
    # llama.cpp sets attn_factor = mscale(scale) / (1 + 0.1 ln scale), cancelling the factor ggml multiplies back.
    mscale = 1.0 if scale <= 1.0 else 1.0 + 0.1 * math.log(scale)
    attn_factor *= mscale / (1.0 + 0.1 * math.log(scale))
    orig_context = int(file.get(K.Rope.SCALING_ORIG_CTX_LEN, 0) or file.get(K.LLM.CONTEXT_LENGTH))
    return ggml_rope(dims, base, neox, freq_scale, 1.0, attn_factor, orig_context, freq_factors=freq_factors)
