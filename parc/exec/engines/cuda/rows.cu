// The softmax's gradient and LayerNormalization, looping over each row; after softmax.cu.

// d loss / d x of y = softmax(x) over a row, from dy (a functor, as a softmax's input) and y:
// y * (dy - sum(dy * y)).
template <typename T, typename Load, typename Store>
__device__ void softmax_grad_loop(const Load& dy, const T* y, const Store& store, long long r, long long cols,
                                  T* shared) {
    const long long at = r * cols;
    T s = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += dy(at + j) * y[at + j];
    s = block_reduce<T>(s, shared, false, (T)0);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) store(at + j, y[at + j] * (dy(at + j) - s));
}

template <typename T>
__global__ void softmax_grad_rows(const T* dy, const T* y, T* dx, long long rows, long long cols) {
    __shared__ T shared[32];
    ROW
    softmax_grad_loop<T>(Plain<T>{dy}, y, Write<T>{dx}, r, cols, shared);
}

// LayerNormalization over a row: its mean, 1 / sqrt(variance + eps), and (x - mean) * inv * scale + bias.
template <typename T>
__global__ void layer_norm_rows(const T* x, const T* scale, const T* bias, int has_bias, T* y, T* mean_out,
                                T* inv_out, long long rows, long long cols, T eps) {
    __shared__ T shared[32];
    ROW
    const long long at = r * cols;
    T s = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += x[at + j];
    const T mean = block_reduce<T>(s, shared, false, (T)0) / (T)cols;
    T v = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) { T d = x[at + j] - mean; v += d * d; }
    const T inv = (T)1 / sqrt(block_reduce<T>(v, shared, false, (T)0) / (T)cols + eps);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
        T o = (x[at + j] - mean) * inv;
        o = o * scale[j];
        y[at + j] = has_bias ? o + bias[j] : o;
    }
    if (threadIdx.x == 0) { mean_out[r] = mean; inv_out[r] = inv; }
}
