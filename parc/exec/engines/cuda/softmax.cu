// Row kernels over a contiguous last axis (`gpu.py`): softmax and log(sum(exp)), looping over each
// row, and the helpers that rows.cu and held.cu build on (`gpu.row_source` joins the three in order).

__device__ float ex(float v) { return expf(v); }
__device__ double ex(double v) { return exp(v); }
__device__ float lg(float v) { return logf(v); }
__device__ double lg(double v) { return log(v); }
template <typename T> __device__ T neg_inf();
template <> __device__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ULL); }

// A block of blockDim.y rows: a warp per row where blockDim.x is 32, else one row (blockDim.y 1).
#define ROW const long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; if (r >= rows) return;

// `pad` stands in for the lanes past the last warp: any element of the row for a max, 0 for a sum.
// A row of one warp (blockDim.x 32) needs only the shuffles: every lane ends with the whole.
template <typename T>
__device__ T block_reduce(T v, T* shared, bool is_max, T pad) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
    for (int o = 16; o > 0; o >>= 1) {
        T other = __shfl_xor_sync(0xffffffff, v, o);
        v = is_max ? (other > v ? other : v) : v + other;
    }
    if (blockDim.x <= 32) return v;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? shared[lane] : pad;
        for (int o = 16; o > 0; o >>= 1) {
            T other = __shfl_xor_sync(0xffffffff, v, o);
            v = is_max ? (other > v ? other : v) : v + other;
        }
        if (lane == 0) shared[0] = v;
    }
    __syncthreads();
    T r = shared[0];
    __syncthreads();
    return r;
}

// The softmax and its gradient read and write through functors, so that a row kernel can take in
// the elementwise tree that makes its input or reads its output (`fusion.RowGroup`): `Load` gives
// element i of the input, `Store` takes element i of the output. The plain kernels read and write
// arrays.
template <typename T> struct Plain { const T* x; __device__ T operator()(long long i) const { return x[i]; } };
template <typename T> struct Write { T* y; __device__ void operator()(long long i, T v) const { y[i] = v; } };

template <typename T, typename Load, typename Store>
__device__ void softmax_loop(const Load& load, const Store& store, long long r, long long cols, T* shared) {
    const long long at = r * cols;
    const T first = load(at);
    T m = first;  // a lower bound of the row's max (NaNs never compare greater: as NumPy, a NaN
                  // in the row makes the sum, and so every output, NaN)
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) { const T v = load(at + j); m = v > m ? v : m; }
    m = block_reduce<T>(m, shared, true, first);
    T s = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += ex(load(at + j) - m);
    s = block_reduce<T>(s, shared, false, (T)0);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) store(at + j, ex(load(at + j) - m) / s);
}

template <typename T>
__global__ void softmax_rows(const T* x, T* y, long long rows, long long cols) {
    __shared__ T shared[32];
    ROW
    softmax_loop<T>(Plain<T>{x}, Write<T>{y}, r, cols, shared);
}

// log(sum(exp(row))) in one pass: each thread keeps a running max m and sum s of exp(v - m),
// rescaling s when m grows; the threads' pairs are then brought to the row's max and summed.
// A NaN makes the row's result NaN; -inf elements add nothing.
template <typename T>
__global__ void logsumexp_rows(const T* x, T* out, long long rows, long long cols) {
    __shared__ T shared[32];
    ROW
    const T* row = x + r * cols;
    T m = neg_inf<T>(), s = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
        const T v = row[j];
        if (v > m) { s = s * ex(m - v) + (T)1; m = v; }
        else if (!(v == m && m == neg_inf<T>())) s += ex(v - m);
    }
    const T top = block_reduce<T>(m, shared, true, neg_inf<T>());
    s = block_reduce<T>(m == top ? s : s * ex(m - top), shared, false, (T)0);
    if (threadIdx.x == 0) out[r] = top + lg(s);
}
