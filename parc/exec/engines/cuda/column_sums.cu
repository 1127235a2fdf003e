// ReduceSum over leading axes: a column sum over a chunk of rows (`gpu.sum_leading`).

template <typename T>
__global__ void column_sums(const T* x, T* out, long long rows, long long cols, long long per_chunk) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    const long long start = (long long)blockIdx.y * per_chunk;
    const long long stop = start + per_chunk < rows ? start + per_chunk : rows;
    T s = 0;
    for (long long r = start; r < stop; ++r) s += x[r * cols + j];
    out[(long long)blockIdx.y * cols + j] = s;
}
