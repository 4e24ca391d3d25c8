// The softmax part of one tile of tiled attention (eqs. 14.1-14.2), fused:
// for each row of a tile's scores, in one visit, the new running maximum
// m' = max(m, max_j s_j), the weights 2^(s_j - m') written over the scores,
// their sum, the rescale factor 2^(m - m'), and the running sum
// l' = l * 2^(m - m') + sum_j 2^(s_j - m'). The scores are in base 2 (log2 e
// folded into the queries); -inf marks a hidden key and gives weight 0. m
// starts at the lowest finite float, so m' is always finite. The matmuls stay
// in torch. attnlib/tiled.py checks every shape before calling.
#include <cmath>
#include <cstdint>

template <typename F>
static void tile_pass(F* scores, F* m, F* l, F* rescale, int64_t rows,
                      int64_t width, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        F* s = scores + r * width;  // one row of the tile, in L1
        F top = m[r];
        for (int64_t j = 0; j < width; ++j) top = s[j] > top ? s[j] : top;
        F sum = 0;
        for (int64_t j = 0; j < width; ++j) {
            s[j] = std::exp2(s[j] - top);  // 2^(-inf) = 0 for a hidden key
            sum += s[j];
        }
        const F factor = std::exp2(m[r] - top);
        rescale[r] = factor;
        l[r] = l[r] * factor + sum;
        m[r] = top;
    }
}

extern "C" void tile_pass_f32(float* scores, float* m, float* l,
                              float* rescale, int64_t rows, int64_t width,
                              int64_t threads) {
    tile_pass(scores, m, l, rescale, rows, width, threads);
}

extern "C" void tile_pass_f64(double* scores, double* m, double* l,
                              double* rescale, int64_t rows, int64_t width,
                              int64_t threads) {
    tile_pass(scores, m, l, rescale, rows, width, threads);
}
