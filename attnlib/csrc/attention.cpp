// Causal attention as explicit loops over flat float32 arrays
// (eqs. 2.2, 4.1, 7.1, 9.1). One sequence, no batch axis, rows laid out
// as in attnlib/loops.py:
//   q [T][Hq*D], k [S][Hkv*D], v [S][Hkv*Dv] -> out [T][Hq*Dv]
//   query_positions [T], key_positions [S]
// Query i sees key j iff kpos[j] <= qpos[i]; query head h reads KV head
// h / (Hq/Hkv). attnlib/native.py checks every size before calling.
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" void attention(const float* q, const float* k, const float* v,
                          int64_t q_heads, int64_t kv_heads,
                          const int64_t* query_positions,
                          const int64_t* key_positions, float scale,
                          int64_t T, int64_t S, int64_t D, int64_t Dv,
                          float* out) {
    const int64_t group = q_heads / kv_heads;
    std::vector<float> weights(S);  // [S]: one row of scores, then weights
    for (int64_t i = 0; i < T; ++i) {
        for (int64_t h = 0; h < q_heads; ++h) {
            const int64_t kv = h / group;                    // eq. 9.1
            const float* query = q + (i * q_heads + h) * D;  // [D]
            float* row = out + (i * q_heads + h) * Dv;       // [Dv]
            for (int64_t e = 0; e < Dv; ++e) row[e] = 0.0f;
            float top = -INFINITY;
            int64_t seen = 0;
            for (int64_t j = 0; j < S; ++j) {
                if (key_positions[j] > query_positions[i]) continue;  // 7.1
                const float* key = k + (j * kv_heads + kv) * D;  // [D]
                float dot = 0.0f;
                for (int64_t e = 0; e < D; ++e) dot += query[e] * key[e];
                weights[j] = dot * scale;  // eq. 3.3
                top = std::fmax(top, weights[j]);
                ++seen;
            }
            if (seen == 0) continue;  // sees no key: zeros
            float total = 0.0f;
            for (int64_t j = 0; j < S; ++j) {
                if (key_positions[j] > query_positions[i]) continue;
                weights[j] = std::exp(weights[j] - top);  // eq. 4.1, stable
                total += weights[j];
            }
            for (int64_t j = 0; j < S; ++j) {
                if (key_positions[j] > query_positions[i]) continue;
                const float* value = v + (j * kv_heads + kv) * Dv;  // [Dv]
                const float weight = weights[j] / total;
                // eq. 2.2: the weighted sum of the values
                for (int64_t e = 0; e < Dv; ++e) row[e] += weight * value[e];
            }
        }
    }
}
