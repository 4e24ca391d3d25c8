// Tiled attention's forward (eqs. 14.1-14.2) as one compiled loop: per query head and block
// of queries, over its key blocks, S = Q K^T (3.3), the hidden keys (5.1, 7.1) set to -inf,
// the softmax steps of eq. 14.1 in one visit of each row of S, and o <- o * 2^(m - m') + P V
// (14.2). A tile lives in one core's cache from its first matmul to its last. The matmuls
// call the BLAS that torch links (sgemm_/dgemm_, passed in by attnlib/native.py) or, where
// there is none, the plain loops of `gemm`. Scores are in base 2 (log2 e folded into the
// queries); m starts at the lowest finite float, so a row that sees no key gets weights 0 and
// output 0, never NaN. attnlib/tiled.py checks every shape and dtype before calling.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

template <typename F>  // Fortran BLAS ?gemm_, column-major
using Blas = void (*)(const char*, const char*, const int*, const int*, const int*, const F*,
                      const F*, const int*, const F*, const int*, const F*, F*, const int*);

// Row-major C [rows, cols] = beta C + A [rows, inner] B, where B is [inner, cols], or, with
// `transposed`, B^T for B [cols, inner].
template <typename F>
static void gemm(Blas<F> blas, bool transposed, int rows, int cols, int inner, const F* a,
                 int lda, const F* b, int ldb, F beta, F* c, int ldc) {
    if (blas) {  // row-major C = A op(B) is column-major C^T = op(B)^T A^T
        const F one = 1;
        blas(transposed ? "T" : "N", "N", &cols, &rows, &inner, &one, b, &ldb, a, &lda, &beta,
             c, &ldc);
        return;
    }
    for (int r = 0; r < rows; ++r) {
        F* out = c + int64_t(r) * ldc;
        for (int j = 0; j < cols; ++j) out[j] = beta == 0 ? F(0) : beta * out[j];
        for (int x = 0; x < inner; ++x) {
            const F left = a[int64_t(r) * lda + x];
            for (int j = 0; j < cols; ++j)
                out[j] += left * (transposed ? b[int64_t(j) * ldb + x] : b[int64_t(x) * ldb + j]);
        }
    }
}

// Eq. 14.1 for one row of scores s [width], in one visit: m' = max(m, max_j s_j), the scores
// replaced by 2^(s_j - m') (0 for -inf), l' = l 2^(m - m') + sum_j 2^(s_j - m'). Returns the
// rescale factor 2^(m - m').
template <typename F>
static inline F row_step(F* s, int64_t width, F& m, F& l) {
    F top = m;
    for (int64_t j = 0; j < width; ++j) top = s[j] > top ? s[j] : top;
    F sum = 0;
    for (int64_t j = 0; j < width; ++j) {
        s[j] = std::exp2(s[j] - top);
        sum += s[j];
    }
    const F factor = std::exp2(m - top);
    l = l * factor + sum;
    m = top;
    return factor;
}

// One tile's softmax steps alone (chapter 14 times them against torch's four passes):
// scores [rows, width] in place, m and l [rows] updated, rescale [rows] written.
template <typename F>
static void tile_pass(F* scores, F* m, F* l, F* rescale, int64_t rows, int64_t width,
                      int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) rescale[r] = row_step(scores + r * width, width, m[r], l[r]);
}

// What a tile of t x s cells of `allowed` (from its cell [0, 0], rows `down` apart, cells
// `across` apart) hides: 0 all of it, 2 none of it, 1 some. A vectorised sweep per row.
static int8_t allowed_tile(const uint8_t* may, int64_t t, int64_t s, int64_t down,
                           int64_t across) {
    uint8_t some = 0, every = 1;
    for (int64_t r = 0; r < t && (every || !some); ++r) {
        const uint8_t* row = may + r * down;
        if (across == 1)
            for (int64_t j = 0; j < s; ++j) some |= row[j], every &= row[j];
        else
            for (int64_t j = 0; j < s; ++j) some |= row[j * across], every &= row[j * across];
    }
    return !some ? 0 : every ? 2 : 1;
}

// q [B, Hq, T, D] (base-2 scaled), k [B, Hkv, S, D], v [B, Hkv, S, Dv], positions [B, T] and
// [B, S], allowed (nullable) read through strides [4] of [B, Hq, T, S] (0 on a broadcast
// axis), states [B, nq, nk] of eq. 7.1: 0 it hides the whole tile, 2 none of it, 1 some.
// Writes out [B, Hq, T, Dv] and, if lse is not null, lse [B, Hq, T] (natural log, +inf for
// a row that sees no key).
template <typename F>
static void forward(const F* q, const F* k, const F* v, const int64_t* query_positions,
                    const int64_t* key_positions, const uint8_t* allowed, const int64_t* stride,
                    const int8_t* states, F* out, F* lse, const int64_t* sizes, int64_t block,
                    int64_t threads, Blas<F> blas) {
    const int64_t batch = sizes[0], q_heads = sizes[1], kv_heads = sizes[2], T = sizes[3];
    const int64_t S = sizes[4], D = sizes[5], Dv = sizes[6];
    const int64_t nq = (T + block - 1) / block, nk = (S + block - 1) / block;
    const int64_t group = q_heads / kv_heads, items = batch * q_heads * nq;
    const F lowest = std::numeric_limits<F>::lowest(), inf = std::numeric_limits<F>::infinity();
    // `allowed`'s own tiles: one per batch row and head it has (not per broadcast copy).
    const int64_t masks_b = stride[0] ? batch : 1, masks_h = stride[1] ? q_heads : 1;
    std::vector<int8_t> masks(allowed ? masks_b * masks_h * nq * nk : 0, 2);
#pragma omp parallel num_threads(threads)
    {
        if (allowed) {  // only the tiles that eq. 7.1 leaves to some batch row
#pragma omp for schedule(dynamic, 16)
            for (int64_t tile = 0; tile < masks_b * masks_h * nq * nk; ++tile) {
                const int64_t kj = tile % nk, qi = tile / nk % nq, bh = tile / (nq * nk);
                const int64_t b = bh / masks_h, h = bh % masks_h;
                bool needed = false;
                for (int64_t c = stride[0] ? b : 0; c < (stride[0] ? b + 1 : batch); ++c)
                    needed |= states[(c * nq + qi) * nk + kj] != 0;
                if (needed)
                    masks[tile] = allowed_tile(
                        allowed + b * stride[0] + h * stride[1] + qi * block * stride[2] +
                            kj * block * stride[3],
                        std::min(block, T - qi * block), std::min(block, S - kj * block),
                        stride[2], stride[3]);
            }
        }  // the implied barrier: every tile's mask is known before the first item
        std::vector<F> scores(block * block), o(block * Dv), m(block), l(block);
        // Dynamic: a core that another process slows takes fewer items, not an equal share.
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t bh = item / nq, qi = nq - 1 - item % nq;  // the longest rows first
            const int64_t b = bh / q_heads, h = bh % q_heads, kv = h / group;  // eq. 9.1
            const int64_t i0 = qi * block, t = std::min(block, T - i0);
            const F* q_block = q + (bh * T + i0) * D;
            const F* keys = k + (b * kv_heads + kv) * S * D;
            const F* values = v + (b * kv_heads + kv) * S * Dv;
            const int8_t* by_positions = states + (b * nq + qi) * nk;
            const int8_t* by_mask = allowed ? masks.data() + (((stride[0] ? b : 0) * masks_h +
                                                               (stride[1] ? h : 0)) * nq + qi) * nk
                                            : nullptr;
            const int64_t* positions = query_positions + b * T + i0;
            std::fill(o.begin(), o.begin() + t * Dv, F(0));
            std::fill(m.begin(), m.begin() + t, lowest);
            std::fill(l.begin(), l.begin() + t, F(0));
            for (int64_t kj = 0; kj < nk; ++kj) {
                const int8_t causal = by_positions[kj], masked = by_mask ? by_mask[kj] : 2;
                if (causal == 0 || masked == 0) continue;
                const int64_t j0 = kj * block, s = std::min(block, S - j0);
                const int64_t* key_pos = key_positions + b * S + j0;
                gemm<F>(blas, true, t, s, D, q_block, D, keys + j0 * D, D, F(0), scores.data(), s);
                for (int64_t r = 0; r < t; ++r) {
                    F* row = scores.data() + r * s;  // hidden keys to -inf, before the softmax
                    if (causal == 1)  // eq. 7.1
                        for (int64_t j = 0; j < s; ++j)
                            row[j] = key_pos[j] > positions[r] ? -inf : row[j];
                    if (masked == 1) {  // `allowed`, eq. 5.1
                        const uint8_t* shown = allowed + b * stride[0] + h * stride[1] +
                                               (i0 + r) * stride[2] + j0 * stride[3];
                        if (stride[3] == 1)
                            for (int64_t j = 0; j < s; ++j) row[j] = shown[j] ? row[j] : -inf;
                        else
                            for (int64_t j = 0; j < s; ++j)
                                row[j] = shown[j * stride[3]] ? row[j] : -inf;
                    }
                    const F factor = row_step(row, s, m[r], l[r]);
                    if (factor != F(1))
                        for (int64_t d = 0; d < Dv; ++d) o[r * Dv + d] *= factor;
                }
                gemm<F>(blas, false, t, Dv, s, scores.data(), s, values + j0 * Dv, Dv, F(1),
                        o.data(), Dv);
            }
            for (int64_t r = 0; r < t; ++r) {  // o / l; L = (m + log2 l) ln 2 (eq. 15.5)
                const F inverse = l[r] > 0 ? F(1) / l[r] : F(0);
                F* row = out + (bh * T + i0 + r) * Dv;
                for (int64_t d = 0; d < Dv; ++d) row[d] = o[r * Dv + d] * inverse;
                if (lse)
                    lse[bh * T + i0 + r] = l[r] > 0 ? (m[r] + std::log2(l[r])) * F(M_LN2) : inf;
            }
        }
    }
}

#define EXPORT(F, NAME)                                                                       \
    extern "C" void tile_pass_##NAME(F* scores, F* m, F* l, F* rescale, int64_t rows,        \
                                     int64_t width, int64_t threads) {                       \
        tile_pass(scores, m, l, rescale, rows, width, threads);                               \
    }                                                                                         \
    extern "C" void tiled_forward_##NAME(                                                    \
        const F* q, const F* k, const F* v, const int64_t* query_positions,                   \
        const int64_t* key_positions, const uint8_t* allowed, const int64_t* stride,          \
        const int8_t* states, F* out, F* lse, const int64_t* sizes, int64_t block,            \
        int64_t threads, void* blas) {                                                        \
        forward<F>(q, k, v, query_positions, key_positions, allowed, stride, states, out, lse, \
                   sizes, block, threads, reinterpret_cast<Blas<F>>(blas));                   \
    }
EXPORT(float, f32)
EXPORT(double, f64)
