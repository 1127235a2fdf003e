// Cast between float32 and bfloat16, four elements a thread (`gpu.cast_bfloat16`); after bf16.cu.

extern "C" __global__ void float_to_bf16(const float* __restrict__ x, unsigned short* __restrict__ y,
                                         unsigned int n) {
    const unsigned int i = (blockIdx.x * blockDim.x + threadIdx.x) * 4u;
    float v[4];
    #pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = i + k < n ? x[i + k] : 0.0f;  // every load before any store
    #pragma unroll
    for (int k = 0; k < 4; ++k) if (i + k < n) y[i + k] = bf16_bits(v[k]);
}

extern "C" __global__ void bf16_to_float(const unsigned short* __restrict__ x, float* __restrict__ y,
                                         unsigned int n) {
    const unsigned int i = (blockIdx.x * blockDim.x + threadIdx.x) * 4u;
    unsigned int v[4];
    #pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = i + k < n ? (unsigned int)x[i + k] : 0u;
    #pragma unroll
    for (int k = 0; k < 4; ++k) if (i + k < n) y[i + k] = __uint_as_float(v[k] << 16);
}
