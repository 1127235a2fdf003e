// A prelude of cast.cu and of the fused kernels that read or write bfloat16 (`fusion.py`).

// float32 -> bfloat16 bits: round to nearest, ties to even (as ml_dtypes, NumPy's bfloat16); a NaN
// stays a quiet NaN of its sign. bfloat16 -> float32 is exact: the bits shifted up.
__device__ unsigned short bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ float bf16_value(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
