//! Causal attention as explicit loops over flat float32 arrays
//! (eqs. 2.2, 4.1, 7.1, 9.1). One sequence, no batch axis, rows laid out
//! as in attnlib/loops.py:
//!   q [T][Hq*D], k [S][Hkv*D], v [S][Hkv*Dv] -> out [T][Hq*Dv]
//!   query_positions [T], key_positions [S]
//! Query i sees key j iff kpos[j] <= qpos[i]; query head h reads KV head
//! h / (Hq/Hkv). attnlib/native.py checks every size before calling.
use std::slice::{from_raw_parts, from_raw_parts_mut};

#[no_mangle]
pub unsafe extern "C" fn attention(
    q: *const f32, k: *const f32, v: *const f32, q_heads: i64, kv_heads: i64,
    query_positions: *const i64, key_positions: *const i64, scale: f32,
    t: i64, s: i64, d: i64, dv: i64, out: *mut f32,
) {
    let (hq, hkv) = (q_heads as usize, kv_heads as usize);
    let (t, s, d, dv) = (t as usize, s as usize, d as usize, dv as usize);
    let q = from_raw_parts(q, t * hq * d); // [T][Hq*D]
    let k = from_raw_parts(k, s * hkv * d); // [S][Hkv*D]
    let v = from_raw_parts(v, s * hkv * dv); // [S][Hkv*Dv]
    let query_positions = from_raw_parts(query_positions, t); // [T]
    let key_positions = from_raw_parts(key_positions, s); // [S]
    let out = from_raw_parts_mut(out, t * hq * dv); // [T][Hq*Dv]
    let mut weights = vec![0.0f32; s]; // [S]: one row of scores, then weights
    for i in 0..t {
        let sees = |j: usize| key_positions[j] <= query_positions[i]; // 7.1
        for h in 0..hq {
            let kv = h / (hq / hkv); // eq. 9.1
            let query = &q[(i * hq + h) * d..][..d]; // [D]
            let row = &mut out[(i * hq + h) * dv..][..dv]; // [Dv]
            row.iter_mut().for_each(|x| *x = 0.0);
            let (mut top, mut seen) = (f32::NEG_INFINITY, false);
            for j in (0..s).filter(|&j| sees(j)) {
                let key = &k[(j * hkv + kv) * d..][..d]; // [D]
                let dot: f32 = query.iter().zip(key).map(|(a, b)| a * b).sum();
                weights[j] = dot * scale; // eq. 3.3
                top = top.max(weights[j]);
                seen = true;
            }
            if !seen {
                continue; // sees no key: zeros
            }
            let mut total = 0.0f32;
            for j in (0..s).filter(|&j| sees(j)) {
                weights[j] = (weights[j] - top).exp(); // eq. 4.1, stable
                total += weights[j];
            }
            for j in (0..s).filter(|&j| sees(j)) {
                let value = &v[(j * hkv + kv) * dv..][..dv]; // [Dv]
                let weight = weights[j] / total;
                axpy(row, value, weight); // eq. 2.2
            }
        }
    }
}

/// row += weight * value, the weighted sum of the values (eq. 2.2).
/// `row` and `value` arrive as reference parameters, which rustc marks
/// `noalias`: LLVM may assume that they do not overlap.
fn axpy(row: &mut [f32], value: &[f32], weight: f32) {
    for (o, x) in row.iter_mut().zip(value) {
        *o += weight * x;
    }
}
