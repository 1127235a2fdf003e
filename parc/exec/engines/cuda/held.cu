// The softmax, its gradient and LayerNormalization for rows of at most PER * blockDim.x elements,
// after softmax.cu and rows.cu: each thread keeps its elements in registers, so a row is read from
// memory once (the loops read it two or three times). Each thread takes the same elements, and adds
// them in the same order, as the loops: same results.

#define EACH for (int k = 0; k < PER; ++k)
#define J (threadIdx.x + (long long)k * blockDim.x)

// Through functors as the looping kernels; element 0 stands in for the lanes past the row's
// end in the max.
template <typename T, int PER, typename Load, typename Store>
__device__ void softmax_held(const Load& load, const Store& store, long long r, long long cols, T* shared) {
    const long long at = r * cols;
    T v[PER];
    const T first = load(at);
    T m = first;
    #pragma unroll
    EACH { v[k] = J < cols ? load(at + J) : first; m = v[k] > m ? v[k] : m; }
    m = block_reduce<T>(m, shared, true, first);
    T s = 0;
    #pragma unroll
    EACH { v[k] = ex(v[k] - m); if (J < cols) s += v[k]; }
    s = block_reduce<T>(s, shared, false, (T)0);
    #pragma unroll
    EACH if (J < cols) store(at + J, v[k] / s);
}

template <typename T, int PER, typename Load, typename Store>
__device__ void softmax_grad_held(const Load& dy, const T* y, const Store& store, long long r, long long cols,
                                  T* shared) {
    const long long at = r * cols;
    T g[PER], v[PER];
    T s = 0;
    #pragma unroll
    EACH if (J < cols) { g[k] = dy(at + J); v[k] = y[at + J]; s += g[k] * v[k]; }
    s = block_reduce<T>(s, shared, false, (T)0);
    #pragma unroll
    EACH if (J < cols) store(at + J, v[k] * (g[k] - s));
}

template <typename T, int PER>
__global__ void softmax_rows_held(const T* x, T* y, long long rows, long long cols) {
    __shared__ T shared[32];
    ROW
    softmax_held<T, PER>(Plain<T>{x}, Write<T>{y}, r, cols, shared);
}

template <typename T, int PER>
__global__ void softmax_grad_rows_held(const T* dy, const T* y, T* dx, long long rows, long long cols) {
    __shared__ T shared[32];
    ROW
    softmax_grad_held<T, PER>(Plain<T>{dy}, y, Write<T>{dx}, r, cols, shared);
}

template <typename T, int PER>
__global__ void layer_norm_rows_held(const T* x, const T* scale, const T* bias, int has_bias, T* y, T* mean_out,
                                     T* inv_out, long long rows, long long cols, T eps) {
    __shared__ T shared[32];
    ROW
    const long long at = r * cols;
    T v[PER];
    T s = 0;
    #pragma unroll
    EACH if (J < cols) { v[k] = x[at + J]; s += v[k]; }
    const T mean = block_reduce<T>(s, shared, false, (T)0) / (T)cols;
    T var = 0;
    #pragma unroll
    EACH if (J < cols) { T d = v[k] - mean; var += d * d; }
    const T inv = (T)1 / sqrt(block_reduce<T>(var, shared, false, (T)0) / (T)cols + eps);
    #pragma unroll
    EACH if (J < cols) {
        T o = (v[k] - mean) * inv;
        o = o * scale[J];
        y[at + J] = has_bias ? o + bias[J] : o;
    }
    if (threadIdx.x == 0) { mean_out[r] = mean; inv_out[r] = inv; }
}
