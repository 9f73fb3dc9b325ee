"""leat.rope against a line-by-line transcription of ggml's rope cache (ggml-cpu/ops.cpp) and llama.cpp's
context setup (llama-context.cpp), in float64."""

import math

import gguf
import numpy as np
import pytest
from leat.modelfile import ModelFile
from leat.rope import ggml_rope, rope_from_metadata


def ggml_rope_cache(pos, dims, base, freq_scale, ext_factor, attn_factor, orig_ctx, beta_fast, beta_slow, ff=None):
    """(cos, sin) per pair, as ggml_rope_cache_init / rope_yarn / ggml_rope_yarn_corr_dims compute them."""

    def corr_dim(n_rot):
        return dims * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0, math.floor(corr_dim(beta_fast))), min(dims - 1, math.ceil(corr_dim(beta_slow)))
    theta_scale = base ** (-2.0 / dims)
    theta, out = float(pos), []
    for i0 in range(0, dims, 2):
        theta_extrap = theta / (ff[i0 // 2] if ff is not None else 1.0)
        theta_interp = freq_scale * theta_extrap
        angle, mscale = theta_interp, attn_factor
        if ext_factor != 0.0:
            y = (i0 // 2 - low) / max(0.001, high - low)
            ramp_mix = (1 - min(1, max(0, y))) * ext_factor
            angle = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        out.append((math.cos(angle) * mscale, math.sin(angle) * mscale))
        theta *= theta_scale
    return np.array(out)


def spec_cache(spec, pos):
    """(cos, sin) per pair that a backend computes from a RopeSpec (the contract's formula)."""
    half = spec.dims // 2
    inv_freq = spec.base ** (-np.arange(half) * 2 / spec.dims)
    if spec.freq_factors is not None:
        inv_freq = inv_freq / spec.freq_factors[:half]
    angles = pos * spec.scale * inv_freq
    return np.stack([np.cos(angles), np.sin(angles)], axis=-1) * spec.attn_factor


@pytest.mark.parametrize(
    "dims, base, freq_scale, ext_factor, attn_factor, orig_ctx, beta_fast, beta_slow, factors",
    [
        (64, 150000.0, 1 / 32, 1.0, 0.8, 4096, 32.0, 1.0, False),  # gpt-oss
        (16, 10000.0, 0.25, 1.0, 1.0, 256, 32.0, 1.0, True),  # ramp inside the range, with rope_freqs
        (16, 10000.0, 0.25, 0.5, 1.0, 256, 8.0, 2.0, False),  # partial extrapolation mix
        (32, 500000.0, 0.5, 0.0, 1.0, 8192, 32.0, 1.0, True),  # linear scaling, no YaRN
    ],
)
def test_ggml_rope_is_ggmls_rotation(
    dims, base, freq_scale, ext_factor, attn_factor, orig_ctx, beta_fast, beta_slow, factors
):
    ff = np.linspace(1.0, 5.0, dims // 2) if factors else None
    spec = ggml_rope(dims, base, True, freq_scale, ext_factor, attn_factor, orig_ctx, beta_fast, beta_slow, ff)
    for pos in [0, 1, 17, 300, 5000, 100000]:
        want = ggml_rope_cache(pos, dims, base, freq_scale, ext_factor, attn_factor, orig_ctx, beta_fast, beta_slow, ff)
        np.testing.assert_allclose(spec_cache(spec, pos), want, rtol=1e-9, atol=1e-9)


def metadata_file(tmp_path, **rope):
    writer = gguf.GGUFWriter(tmp_path / "rope.gguf", "qwen3")
    writer.add_context_length(40960)
    writer.add_rope_freq_base(1e6)
    if "kind" in rope:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["kind"]))
    if "factor" in rope:
        writer.add_rope_scaling_factor(rope["factor"])
    if "orig" in rope:
        writer.add_rope_scaling_orig_ctx_len(rope["orig"])
    if "attn" in rope:
        writer.add_rope_scaling_attn_factors(rope["attn"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelFile(tmp_path / "rope.gguf")


def test_rope_from_metadata_follows_llama_cpp_context_setup(tmp_path):
    plain = rope_from_metadata(metadata_file(tmp_path), 128, neox=True)
    assert (plain.scale, plain.freq_factors, plain.attn_factor, plain.base) == (1.0, None, 1.0, 1e6)
    linear = rope_from_metadata(metadata_file(tmp_path, kind="linear", factor=4.0), 128, neox=True)
    assert (linear.scale, linear.freq_factors, linear.attn_factor) == (0.25, None, 1.0)
    # "none" never scales, whatever the factor
    assert rope_from_metadata(metadata_file(tmp_path, kind="none", factor=4.0), 128, neox=True).scale == 1.0
    # yarn: ext_factor 1, llama.cpp's attn_factor mscale(4)/(1 + 0.1 ln 4) = 1, so ggml's magnitude is 1 + 0.1 ln 4;
    # original context from the key, else the training context
    yarn = rope_from_metadata(metadata_file(tmp_path, kind="yarn", factor=4.0, orig=32768, attn=0.9), 128, neox=True)
    want = ggml_rope(128, 1e6, True, 0.25, 1.0, 0.9, 32768)
    np.testing.assert_allclose(yarn.freq_factors, want.freq_factors)
    assert yarn.attn_factor == pytest.approx(0.9 * (1 + 0.1 * math.log(4)))
    untrained = rope_from_metadata(metadata_file(tmp_path, kind="yarn", factor=4.0), 128, neox=True, base=1e4)
    np.testing.assert_allclose(untrained.freq_factors, ggml_rope(128, 1e4, True, 0.25, 1.0, 1.0, 40960).freq_factors)
